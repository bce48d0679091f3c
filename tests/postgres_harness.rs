//! The PostgreSQL test harness itself (tests/common/postgres.rs): databases are separate and usable, and the
//! server stops (refusing connections) and starts again with its data, repeatedly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::TcpStream;
use std::sync::Mutex;
use std::time::Duration;

use common::postgres;

/// The server is shared by the tests of this process: the restart test must not stop it under the other.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn two_databases_are_distinct_and_usable() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pg = postgres::server();
    let a = pg.database("harness a");
    let b = pg.database("harness b");
    assert_ne!(a, b);
    assert!(
        a.starts_with(&format!("postgres://postgres@127.0.0.1:{}/", pg.port())),
        "{a}"
    );

    pg.psql(
        &a,
        "CREATE TABLE t (id int, name text); INSERT INTO t VALUES (1, 'one'), (2, 'two');",
    );
    pg.psql(
        &b,
        "CREATE TABLE t (id int, name text); INSERT INTO t VALUES (3, 'three');",
    );
    assert_eq!(pg.psql(&a, "SELECT id, name FROM t ORDER BY id"), "1\tone\n2\ttwo\n");
    assert_eq!(pg.psql(&b, "SELECT id, name FROM t ORDER BY id"), "3\tthree\n");
    assert_eq!(
        pg.psql(&a, "SELECT current_database()").trim(),
        a.rsplit('/').next().unwrap()
    );
}

#[test]
fn stop_refuses_connections_and_start_brings_the_data_back() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pg = postgres::server();
    let db = pg.database("restart");
    pg.psql(
        &db,
        "CREATE TABLE kept (v text); INSERT INTO kept VALUES ('before the stop');",
    );
    let addr = format!("127.0.0.1:{}", pg.port()).parse().unwrap();
    let mut expected = "before the stop\n".to_owned();
    for round in 0..2 {
        pg.stop();
        assert!(
            TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(),
            "round {round}: the port accepts after stop()"
        );
        pg.stop(); // stopping a stopped server is a no-op
        pg.start();
        assert_eq!(pg.psql(&db, "SELECT v FROM kept ORDER BY v"), expected, "round {round}");
        pg.psql(&db, &format!("INSERT INTO kept VALUES ('round {round}')"));
        expected.push_str(&format!("round {round}\n"));
    }
    assert_eq!(pg.psql(&db, "SELECT v FROM kept ORDER BY v"), expected);
}
