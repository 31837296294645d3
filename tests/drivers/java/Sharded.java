// pgjdbc through a sharded endpoint: rows copied in and out (CopyManager) and inserted in a batch (one
// Sync for all of it), read by key and fanned out in server-side prepared statements
// (prepareThreshold=1), a transaction over both shards committed and one rolled back, a fan-out
// read a few rows at a time (fetch size: a portal suspended and resumed), a refusal. Table
// accounts(aid int primary key, abalance int, note text), sharded by aid, exists and is empty.
import java.io.StringReader;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.util.ArrayList;
import java.util.List;

import org.postgresql.PGConnection;

public class Sharded {
    static final List<String> failures = new ArrayList<>();

    static Connection connect() throws Exception {
        String url = String.format("jdbc:postgresql://%s:%s/%s?prepareThreshold=1",
                System.getenv("PGHERD_HOST"), System.getenv("PGHERD_PORT"), System.getenv("PGHERD_DB"));
        return DriverManager.getConnection(url, System.getenv("PGHERD_USER"), System.getenv("PGHERD_PASSWORD"));
    }

    static void check(String what, Object got, Object expected) {
        if (!String.valueOf(got).equals(String.valueOf(expected))) {
            failures.add(what + ": got " + got + ", expected " + expected);
        }
    }

    static String rows(ResultSet rs) throws SQLException {
        StringBuilder out = new StringBuilder();
        int columns = rs.getMetaData().getColumnCount();
        while (rs.next()) {
            for (int i = 1; i <= columns; i++) {
                out.append(i == 1 ? "" : ",").append(rs.getString(i));
            }
            out.append(";");
        }
        return out.toString();
    }

    public static void main(String[] args) throws Exception {
        try (Connection c = connect()) {
            StringBuilder copy = new StringBuilder();
            for (int aid = 1; aid <= 200; aid++) {
                copy.append(aid).append('\t').append(aid * 10).append("\tn").append(aid).append('\n');
            }
            long copied = c.unwrap(PGConnection.class).getCopyAPI()
                    .copyIn("COPY accounts (aid, abalance, note) FROM STDIN", new StringReader(copy.toString()));
            check("copied", copied, 200);
            try (PreparedStatement insert = c.prepareStatement(
                    "INSERT INTO accounts (aid, abalance, note) VALUES (?, ?, ?)")) {
                for (int aid = 201; aid <= 300; aid++) {
                    insert.setInt(1, aid);
                    insert.setInt(2, aid * 10);
                    insert.setString(3, "n" + aid);
                    insert.addBatch();
                }
                check("batch", insert.executeBatch().length, 100);
            }
            // A batch that fails part-way leaves nothing behind: one implicit transaction.
            try (PreparedStatement insert = c.prepareStatement(
                    "INSERT INTO accounts (aid, abalance, note) VALUES (?, 0, 'dup')")) {
                for (int aid : new int[] {301, 302, 1}) {
                    insert.setInt(1, aid);
                    insert.addBatch();
                }
                int[] counts = insert.executeBatch();
                failures.add("a batch with a duplicate key was not refused: " + java.util.Arrays.toString(counts));
            } catch (SQLException e) {
                check("duplicate in a batch", e.getSQLState(), "23505");
            }
            try (PreparedStatement byKey = c.prepareStatement(
                    "SELECT abalance, note FROM accounts WHERE aid = ?")) {
                for (int aid : new int[] {1, 150, 299, 301}) {
                    byKey.setInt(1, aid);
                    try (ResultSet rs = byKey.executeQuery()) {
                        check("row " + aid, rows(rs), aid <= 300 ? (aid * 10) + ",n" + aid + ";" : "");
                    }
                }
            }
            try (PreparedStatement sums = c.prepareStatement(
                    "SELECT count(*), sum(abalance), max(aid) FROM accounts WHERE abalance >= ?")) {
                for (int round = 0; round < 3; round++) {
                    sums.setInt(1, 100);
                    try (ResultSet rs = sums.executeQuery()) {
                        long sum = 0;
                        for (int a = 10; a <= 300; a++) {
                            sum += a * 10L;
                        }
                        check("aggregates", rows(rs), "291," + sum + ",300;");
                    }
                }
            }

            c.setAutoCommit(false);
            try (PreparedStatement update = c.prepareStatement(
                    "UPDATE accounts SET abalance = abalance + ? WHERE aid = ?")) {
                for (int aid : new int[] {1, 2}) {
                    update.setInt(1, 1);
                    update.setInt(2, aid);
                    update.executeUpdate();
                }
                c.commit();
                for (int aid : new int[] {3, 4}) {
                    update.setInt(1, -1000);
                    update.setInt(2, aid);
                    update.executeUpdate();
                }
                c.rollback();
            }
            try (PreparedStatement some = c.prepareStatement(
                    "SELECT aid, abalance FROM accounts WHERE aid <= ? ORDER BY aid")) {
                some.setInt(1, 4);
                try (ResultSet rs = some.executeQuery()) {
                    check("transactions", rows(rs), "1,11;2,21;3,30;4,40;");
                }
            }
            // Ten rows a fetch: pgjdbc reads the portal with a row limit.
            try (PreparedStatement all = c.prepareStatement(
                    "SELECT aid FROM accounts WHERE aid > ? ORDER BY aid")) {
                all.setFetchSize(10);
                all.setInt(1, 0);
                int expected = 1;
                try (ResultSet rs = all.executeQuery()) {
                    while (rs.next()) {
                        check("fetched row", rs.getInt(1), expected);
                        expected++;
                    }
                }
                check("fetched rows", expected - 1, 300);
            }
            c.commit();
            c.setAutoCommit(true);
            // COPY TO over every shard: one COPY, the rows of all of them.
            java.io.StringWriter out = new java.io.StringWriter();
            long copiedOut = c.unwrap(PGConnection.class).getCopyAPI()
                    .copyOut("COPY accounts (aid) TO STDOUT", out);
            check("copied out", copiedOut, 300L);
            check("copied out lines", out.toString().split("\n").length, 300);
            try (PreparedStatement window = c.prepareStatement(
                    "SELECT aid, count(*) OVER () FROM accounts WHERE aid > ?")) {
                window.setInt(1, 0);
                window.executeQuery();
                failures.add("a window function over the shards was not refused");
            } catch (SQLException e) {
                check("refusal", e.getSQLState(), "0A000");
            }
            try (ResultSet rs = c.createStatement().executeQuery("SELECT note FROM accounts WHERE aid = 5")) {
                check("after a refusal", rows(rs), "n5;");
            }
        }
        if (!failures.isEmpty()) {
            failures.forEach(System.err::println);
            System.exit(1);
        }
        System.out.println("pgjdbc through a sharded endpoint: ok");
    }
}
