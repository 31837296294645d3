use super::*;

fn copy_of(sql: &str) -> Result<CopyIn, CopyError> {
    let parsed = pg_query::parse(sql).unwrap();
    let Some(NodeEnum::CopyStmt(copy)) = parsed.protobuf.stmts[0]
        .stmt
        .as_ref()
        .and_then(|s| s.node.as_ref())
    else {
        panic!("not a COPY: {sql}");
    };
    copy_in(copy)
}

fn text() -> CopyFormat {
    CopyFormat::Text {
        delimiter: b'\t',
        null: b"\\N".to_vec(),
    }
}

fn csv() -> CopyFormat {
    CopyFormat::Csv {
        delimiter: b',',
        quote: b'"',
        escape: b'"',
        null: Vec::new(),
    }
}

#[test]
fn the_format_comes_from_the_options() {
    assert_eq!(
        copy_of("COPY t FROM STDIN").unwrap(),
        CopyIn {
            format: text(),
            header: false,
            columns: vec![]
        }
    );
    assert_eq!(
        copy_of("COPY t (a, b) FROM STDIN WITH (FORMAT csv, HEADER)").unwrap(),
        CopyIn {
            format: csv(),
            header: true,
            columns: vec!["a".into(), "b".into()]
        }
    );
    assert_eq!(
        copy_of("COPY t FROM STDIN CSV DELIMITER ';' NULL 'NA' QUOTE '''' ESCAPE '\\'")
            .unwrap()
            .format,
        CopyFormat::Csv {
            delimiter: b';',
            quote: b'\'',
            escape: b'\\',
            null: b"NA".to_vec()
        }
    );
    assert_eq!(
        copy_of("COPY t FROM STDIN (DELIMITER '|', NULL '')")
            .unwrap()
            .format,
        CopyFormat::Text {
            delimiter: b'|',
            null: Vec::new()
        }
    );
    for refused in [
        "COPY t TO STDOUT",
        "COPY t FROM '/tmp/x'",
        "COPY t FROM STDIN (FORMAT binary)",
        "COPY t FROM STDIN (DELIMITER '||')",
        "COPY t FROM STDIN (FORMAT csv, HEADER match)",
    ] {
        assert!(
            matches!(copy_of(refused), Err(CopyError::Unsupported(_))),
            "{refused}"
        );
    }
}

/// Rows cut at every possible CopyData boundary come out the same.
fn rows_of(format: CopyFormat, data: &[u8]) -> Vec<Vec<u8>> {
    let mut whole = Vec::new();
    let mut splitter = RowSplitter::new(format.clone());
    let mut take = |row: &[u8]| {
        whole.push(row.to_vec());
        Ok(())
    };
    splitter.push(data, &mut take).unwrap();
    splitter.finish(&mut take).unwrap();
    for cut in 0..=data.len() {
        let mut pieces = Vec::new();
        let mut splitter = RowSplitter::new(format.clone());
        let mut take = |row: &[u8]| {
            pieces.push(row.to_vec());
            Ok(())
        };
        splitter.push(&data[..cut], &mut take).unwrap();
        splitter.push(&data[cut..], &mut take).unwrap();
        splitter.finish(&mut take).unwrap();
        assert_eq!(pieces, whole, "cut at {cut}");
    }
    whole
}

#[test]
fn rows_are_cut_where_the_server_cuts_them() {
    let text_rows = rows_of(text(), b"1\ta\\nb\n2\t\\N\r\n3\tlast");
    assert_eq!(
        text_rows,
        vec![
            b"1\ta\\nb\n".to_vec(),
            b"2\t\\N\r\n".to_vec(),
            b"3\tlast".to_vec()
        ]
    );
    // A quoted newline is data; the end marker ends the data.
    let csv_rows = rows_of(
        csv(),
        b"1,\"two\nlines\"\n2,\"a \"\"quote\"\"\"\n\\.\n3,ignored\n",
    );
    assert_eq!(
        csv_rows,
        vec![
            b"1,\"two\nlines\"\n".to_vec(),
            b"2,\"a \"\"quote\"\"\"\n".to_vec()
        ]
    );
    let mut splitter = RowSplitter::new(text());
    let lone_cr = splitter.push(b"1\ta\r2\tb\n", &mut |_| Ok(()));
    assert!(matches!(lone_cr, Err(CopyError::Row { .. })), "{lone_cr:?}");
}

#[test]
fn key_fields_read_as_the_server_reads_them() {
    let key = |format: &CopyFormat, line: &[u8], index| key_field(format, line, index, 1);
    assert_eq!(key(&text(), b"7\tx\n", 0), Ok(Some("7".into())));
    assert_eq!(key(&text(), b"7\t\\N\n", 1), Ok(None));
    assert_eq!(
        key(&text(), b"7\ta\\tb\\\\c\\101\\x42\r\n", 1),
        Ok(Some("a\tb\\cAB".into()))
    );
    assert!(key(&text(), b"7\n", 1).is_err());
    assert_eq!(key(&csv(), b"1,\"x,y\",3\n", 1), Ok(Some("x,y".into())));
    assert_eq!(key(&csv(), b"1,,3\n", 1), Ok(None));
    assert_eq!(key(&csv(), b"1,\"\",3\n", 1), Ok(Some(String::new())));
    assert_eq!(
        key(&csv(), b"1,\"a \"\"q\"\"\",3\n", 1),
        Ok(Some("a \"q\"".into()))
    );
    assert_eq!(key(&csv(), b"1,2,\"three\"\n", 2), Ok(Some("three".into())));
    let backslash = CopyFormat::Csv {
        delimiter: b',',
        quote: b'"',
        escape: b'\\',
        null: Vec::new(),
    };
    assert_eq!(
        key(&backslash, b"\"a\\\"b\\\\\",2\n", 0),
        Ok(Some("a\"b\\".into()))
    );
}
