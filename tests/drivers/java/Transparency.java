// What pgjdbc sees through pgherd must be what it sees from PostgreSQL: unlogged tables and a
// standby's settings with replicas behind pgherd, the server's ParameterStatus values,
// server-side statements kept across a type made again, DISCARD ALL (pgjdbc prepares its
// statements again after it), and in session mode the backend's process id and the process
// id on its own notifications.
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.Statement;
import org.postgresql.PGConnection;
import org.postgresql.PGNotification;

public class Transparency {
    interface Step {
        void run() throws Exception;
    }

    static Connection connect(String db) throws Exception {
        String url = String.format("jdbc:postgresql://%s:%s/%s?prepareThreshold=1",
                System.getenv("PGHERD_HOST"), System.getenv("PGHERD_PORT"), db);
        return DriverManager.getConnection(url, System.getenv("PGHERD_USER"), System.getenv("PGHERD_PASSWORD"));
    }

    static Connection connect() throws Exception {
        return connect(System.getenv("PGHERD_DB"));
    }

    static void check(boolean ok, String what) {
        if (!ok) throw new IllegalStateException(what);
    }

    static String text(PreparedStatement ps) throws Exception {
        try (ResultSet rs = ps.executeQuery()) {
            rs.next();
            return rs.getString(1);
        }
    }

    static void exec(Connection c, String sql) throws Exception {
        try (Statement s = c.createStatement()) {
            s.execute(sql);
        }
    }

    static void unloggedTable() throws Exception {
        try (Connection c = connect()) {
            exec(c, "CREATE UNLOGGED TABLE ul_jdbc (x int)");
            exec(c, "INSERT INTO ul_jdbc SELECT generate_series(1, 3)");
        }
        try (Connection c = connect(); PreparedStatement ps = c.prepareStatement("SELECT count(*) FROM ul_jdbc WHERE x > ?")) {
            ps.setInt(1, 0);
            String n = text(ps);
            check(n.equals("3"), n + " rows");
        }
    }

    static void standbySetting() throws Exception {
        try (Connection c = connect(); PreparedStatement ps = c.prepareStatement("SELECT current_setting('transaction_read_only')")) {
            String v = text(ps);
            check(v.equals("off"), "transaction_read_only = " + v + " outside a read-only transaction");
        }
    }

    static void parameterStatus() throws Exception {
        try (Connection c = connect()) {
            String v = c.unwrap(PGConnection.class).getParameterStatus("client_encoding");
            check("UTF8".equals(v), "client_encoding reported as " + v);
        }
    }

    static void typeMadeAgain() throws Exception {
        try (Connection c = connect(); Connection other = connect()) {
            exec(other, "CREATE TYPE mood_jdbc AS ENUM ('sad', 'ok')");
            PreparedStatement ps = c.prepareStatement("SELECT ?::text::mood_jdbc::text");
            for (String v : new String[] {"ok", "sad"}) {
                ps.setString(1, v);
                check(text(ps).equals(v), v);
            }
            exec(other, "DROP TYPE mood_jdbc");
            exec(other, "CREATE TYPE mood_jdbc AS ENUM ('sad', 'ok', 'happy')");
            ps.setString(1, "happy");
            check(text(ps).equals("happy"), "after the type was made again");
            c.setAutoCommit(false);
            exec(c, "SAVEPOINT s");
            exec(c, "DROP TYPE mood_jdbc");
            exec(c, "CREATE TYPE mood_jdbc AS ENUM ('only')");
            ps.setString(1, "only");
            check(text(ps).equals("only"), "inside the savepoint");
            exec(c, "ROLLBACK TO SAVEPOINT s");
            ps.setString(1, "happy");
            check(text(ps).equals("happy"), "after the savepoint rolled back");
            c.commit();
        }
    }

    static void discardAll() throws Exception {
        try (Connection c = connect()) {
            PreparedStatement ps = c.prepareStatement("SELECT ?::int * 2");
            for (int round = 0; round < 3; round++) {
                for (int i = 0; i < 3; i++) {
                    ps.setInt(1, i);
                    check(text(ps).equals(String.valueOf(i * 2)), "round " + round);
                }
                exec(c, "DISCARD ALL");
            }
        }
    }

    static void ownNotification(String db, boolean session) throws Exception {
        try (Connection c = connect(db)) {
            PGConnection pg = c.unwrap(PGConnection.class);
            int pid = pg.getBackendPID();
            if (session) {
                try (PreparedStatement ps = c.prepareStatement("SELECT pg_backend_pid()")) {
                    String backend = text(ps);
                    check(backend.equals(String.valueOf(pid)), "pg_backend_pid() " + backend + ", driver knows " + pid);
                }
            }
            exec(c, "LISTEN ch_jdbc");
            exec(c, "NOTIFY ch_jdbc, 'hi'");
            PGNotification[] notes = pg.getNotifications(10_000);
            check(notes != null && notes.length == 1, "one notification");
            check(notes[0].getPID() == pid, "notification from " + notes[0].getPID() + ", driver knows " + pid);
        }
    }

    public static void main(String[] args) throws Exception {
        String[] names = {
            "unlogged table read in a new session", "transaction_read_only", "ParameterStatus",
            "type made again", "DISCARD ALL", "own notifications (transaction mode)",
            "backend identity (session mode)",
        };
        Step[] steps = {
            Transparency::unloggedTable, Transparency::standbySetting, Transparency::parameterStatus,
            Transparency::typeMadeAgain, Transparency::discardAll,
            () -> ownNotification(System.getenv("PGHERD_DB"), false),
            () -> ownNotification(System.getenv("PGHERD_SESSION_DB"), true),
        };
        // Every step runs, so one run shows every difference.
        int failed = 0;
        for (int i = 0; i < steps.length; i++) {
            try {
                steps[i].run();
                System.out.println("pgjdbc: " + names[i] + " ok");
            } catch (Exception e) {
                System.err.println("pgjdbc: " + names[i] + ": " + e);
                failed++;
            }
        }
        if (failed > 0) {
            System.err.println("pgjdbc: " + failed + " of " + steps.length + " checks failed");
            System.exit(1);
        }
    }
}
