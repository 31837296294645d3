// node-postgres through pgherd's transaction pooling. Every client prepares a statement named
// "calc" with a text of its own: names collide across clients, texts differ.
const { Client } = require("pg");

const CLIENTS = parseInt(process.env.CLIENTS || "40", 10);
const ITERATIONS = parseInt(process.env.ITERATIONS || "50", 10);
const config = {
  host: process.env.PGHERD_HOST,
  port: parseInt(process.env.PGHERD_PORT, 10),
  user: process.env.PGHERD_USER,
  password: process.env.PGHERD_PASSWORD,
  database: process.env.PGHERD_DB,
};

async function client(n) {
  const c = new Client(config);
  await c.connect();
  try {
    for (let i = 0; i < ITERATIONS; i++) {
      const k = ((n * ITERATIONS + i) % 1000) + 1;
      const kv = await c.query({ name: "get-kv", text: "SELECT v FROM kv WHERE k = $1", values: [k] });
      if (kv.rows[0].v !== `v${k}`) throw new Error(`kv ${k}: ${kv.rows[0].v}`);
      const calc = await c.query({ name: "calc", text: `SELECT $1::int * 1000 + ${n} AS x`, values: [i] });
      if (calc.rows[0].x !== i * 1000 + n) throw new Error(`client ${n} ran another client's statement: ${calc.rows[0].x}`);
      await c.query("BEGIN");
      await c.query({ name: "log", text: "INSERT INTO driver_log VALUES ($1, $2, $3)", values: ["node-postgres", n, i] });
      await c.query("COMMIT");
    }
  } finally {
    await c.end();
  }
}

(async () => {
  await Promise.all([...Array(CLIENTS).keys()].map(client));
  const c = new Client(config);
  await c.connect();
  const r = await c.query("SELECT count(*)::int AS n FROM driver_log WHERE driver = 'node-postgres'");
  await c.end();
  if (r.rows[0].n !== CLIENTS * ITERATIONS) {
    console.error(`expected ${CLIENTS * ITERATIONS} rows, found ${r.rows[0].n}`);
    process.exit(1);
  }
  console.log(`node-postgres: ${CLIENTS} clients x ${ITERATIONS} iterations ok`);
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
