// pgjdbc through pgherd's transaction pooling. prepareThreshold=1 makes pgjdbc prepare
// server-side statements named S_1, S_2, ... on every connection: the same names, different
// texts across clients.
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;

public class Drivers {
    static String url() {
        return String.format("jdbc:postgresql://%s:%s/%s?prepareThreshold=1",
                System.getenv("PGHERD_HOST"), System.getenv("PGHERD_PORT"), System.getenv("PGHERD_DB"));
    }

    static Connection connect() throws Exception {
        return DriverManager.getConnection(url(), System.getenv("PGHERD_USER"), System.getenv("PGHERD_PASSWORD"));
    }

    static int env(String name, int fallback) {
        String v = System.getenv(name);
        return v == null ? fallback : Integer.parseInt(v);
    }

    public static void main(String[] args) throws Exception {
        int clients = env("CLIENTS", 40);
        int iterations = env("ITERATIONS", 50);
        ExecutorService pool = Executors.newFixedThreadPool(clients);
        List<Future<?>> futures = new ArrayList<>();
        for (int n = 0; n < clients; n++) {
            final int client = n;
            futures.add(pool.submit(() -> { run(client, iterations); return null; }));
        }
        for (Future<?> f : futures) {
            f.get();
        }
        pool.shutdown();
        try (Connection c = connect(); ResultSet rs = c.createStatement()
                .executeQuery("SELECT count(*) FROM driver_log WHERE driver = 'pgjdbc'")) {
            rs.next();
            if (rs.getInt(1) != clients * iterations) {
                System.err.println("expected " + clients * iterations + " rows, found " + rs.getInt(1));
                System.exit(1);
            }
        }
        System.out.println("pgjdbc: " + clients + " clients x " + iterations + " iterations ok");
    }

    static void run(int n, int iterations) throws Exception {
        try (Connection c = connect()) {
            PreparedStatement kv = c.prepareStatement("SELECT v FROM kv WHERE k = ?");
            PreparedStatement calc = c.prepareStatement("SELECT ?::int * 1000 + " + n);
            PreparedStatement log = c.prepareStatement("INSERT INTO driver_log VALUES ('pgjdbc', ?, ?)");
            for (int i = 0; i < iterations; i++) {
                int k = (n * iterations + i) % 1000 + 1;
                kv.setInt(1, k);
                try (ResultSet rs = kv.executeQuery()) {
                    rs.next();
                    if (!rs.getString(1).equals("v" + k)) throw new IllegalStateException("kv " + k);
                }
                calc.setInt(1, i);
                try (ResultSet rs = calc.executeQuery()) {
                    rs.next();
                    if (rs.getInt(1) != i * 1000 + n) throw new IllegalStateException("client " + n + " ran another client's statement");
                }
                c.setAutoCommit(false);
                log.setInt(1, n);
                log.setInt(2, i);
                log.executeUpdate();
                c.commit();
                c.setAutoCommit(true);
            }
        }
    }
}
