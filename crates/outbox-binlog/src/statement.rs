//! What a statement the server logged as such (a session whose `binlog_format` is not ROW)
//! inserts into: the target of an INSERT, REPLACE or LOAD DATA, read as the server reads it,
//! past comments and string literals. Only the target counts: a statement that reads the
//! outbox (`INSERT INTO archive SELECT … FROM outbox`) or names it in a value
//! (pt-table-checksum's `REPLACE INTO percona.checksums … SELECT 'shop', 'outbox', …`)
//! writes no outbox row, and passes.

/// A token of a statement: comments and blanks are skipped.
#[derive(Debug, PartialEq)]
enum Token<'a> {
    /// An unquoted word: a keyword or an identifier.
    Word(&'a str),
    /// A quoted identifier: `` `…` ``, or `"…"` (ANSI_QUOTES; a string otherwise, which is
    /// never where a table name is).
    Quoted(String),
    /// A string literal (`'…'`), whose text never matters here.
    Text,
    /// Any other character.
    Punct(char),
}

/// The tokens of a statement, as the server splits them: blanks, `/* … */`, `-- …` and
/// `# …` comments skipped, and the text of a versioned comment (`/*!50001 … */`,
/// MariaDB's `/*M! … */`), which the server runs, read as the statement's.
struct Tokens<'a> {
    rest: &'a str,
    /// Inside a versioned comment: its `*/` ends it.
    versioned: bool,
}

fn word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '$' || !c.is_ascii()
}

impl<'a> Tokens<'a> {
    fn new(statement: &'a str) -> Self {
        Tokens {
            rest: statement,
            versioned: false,
        }
    }

    /// Skips blanks and comments; false at an unterminated comment (nothing follows).
    fn skip_blanks(&mut self) -> bool {
        loop {
            self.rest = self.rest.trim_start();
            let rest = self.rest;
            if let Some(after) = rest
                .strip_prefix("/*!")
                .or_else(|| rest.strip_prefix("/*M!"))
            {
                self.rest = after.trim_start_matches(|c: char| c.is_ascii_digit());
                self.versioned = true;
            } else if let Some(after) = rest.strip_prefix("*/").filter(|_| self.versioned) {
                self.rest = after;
                self.versioned = false;
            } else if let Some(after) = rest.strip_prefix("/*") {
                match after.split_once("*/") {
                    Some((_, after)) => self.rest = after,
                    None => return false,
                }
            } else if rest.starts_with('#')
                || rest.strip_prefix("--").is_some_and(|after| {
                    after.is_empty() || after.starts_with(|c: char| c.is_whitespace())
                })
            {
                self.rest = rest.split_once('\n').map_or("", |(_, after)| after);
            } else {
                return true;
            }
        }
    }

    /// The quoted text after `quote` at the start of `self.rest`, its doubled quotes (and,
    /// where `escapes`, its backslash escapes) read; `None` when it never ends.
    fn quoted(&mut self, quote: char, escapes: bool) -> Option<String> {
        let mut text = String::new();
        let mut chars = self.rest[quote.len_utf8()..].char_indices();
        let start = quote.len_utf8();
        while let Some((at, c)) = chars.next() {
            if c == quote {
                if self.rest[start + at + 1..].starts_with(quote) {
                    chars.next();
                    text.push(quote);
                    continue;
                }
                self.rest = &self.rest[start + at + 1..];
                return Some(text);
            }
            if c == '\\' && escapes {
                if let Some((_, escaped)) = chars.next() {
                    text.push(escaped);
                }
                continue;
            }
            text.push(c);
        }
        None
    }
}

impl<'a> Iterator for Tokens<'a> {
    type Item = Token<'a>;

    fn next(&mut self) -> Option<Token<'a>> {
        if !self.skip_blanks() {
            return None;
        }
        let c = self.rest.chars().next()?;
        match c {
            '`' => self.quoted('`', false).map(Token::Quoted),
            '"' => self.quoted('"', true).map(Token::Quoted),
            '\'' => self.quoted('\'', true).map(|_| Token::Text),
            c if word_char(c) => {
                let end = self.rest.find(|c| !word_char(c)).unwrap_or(self.rest.len());
                let (word, rest) = self.rest.split_at(end);
                self.rest = rest;
                Some(Token::Word(word))
            }
            c => {
                self.rest = &self.rest[c.len_utf8()..];
                Some(Token::Punct(c))
            }
        }
    }
}

/// What a statement writes rows to: its verb (`INSERT`, `REPLACE`, `LOAD DATA`) and target
/// table, qualified or not. `Some` with no target where the statement is one of those and
/// its target cannot be read.
#[derive(Debug, PartialEq)]
struct Insert {
    verb: &'static str,
    target: Option<(Option<String>, String)>,
}

fn insert(statement: &str) -> Option<Insert> {
    let mut tokens = Tokens::new(statement).peekable();
    let is = |token: Option<&Token<'_>>, keyword: &str| matches!(token, Some(Token::Word(w)) if w.eq_ignore_ascii_case(keyword));
    let mut first = tokens.next();
    // MariaDB's `SET STATEMENT var = value [, …] FOR statement` runs (and logs) the
    // statement after FOR with those settings.
    if is(first.as_ref(), "SET") && is(tokens.peek(), "STATEMENT") {
        let mut depth = 0usize;
        loop {
            match tokens.next()? {
                Token::Punct('(') => depth += 1,
                Token::Punct(')') => depth = depth.saturating_sub(1),
                Token::Word(w) if depth == 0 && w.eq_ignore_ascii_case("FOR") => break,
                _ => {}
            }
        }
        first = tokens.next();
    }
    let Some(Token::Word(verb)) = first else {
        return None;
    };
    let (verb, modifiers): (_, &[&str]) = match verb.to_ascii_uppercase().as_str() {
        "INSERT" => (
            "INSERT",
            &["LOW_PRIORITY", "DELAYED", "HIGH_PRIORITY", "IGNORE", "INTO"],
        ),
        "REPLACE" => ("REPLACE", &["LOW_PRIORITY", "DELAYED", "INTO"]),
        // LOAD DATA | XML [LOW_PRIORITY | CONCURRENT] [LOCAL] INFILE 'file'
        // [REPLACE | IGNORE] INTO TABLE: its target follows INTO TABLE (the file's name is
        // a string, read past). LOAD INDEX INTO CACHE writes no row.
        "LOAD" => {
            let verb = match tokens.next() {
                Some(Token::Word(w)) if w.eq_ignore_ascii_case("DATA") => "LOAD DATA",
                Some(Token::Word(w)) if w.eq_ignore_ascii_case("XML") => "LOAD XML",
                _ => return None,
            };
            while let Some(token) = tokens.next() {
                if is(Some(&token), "INTO") && is(tokens.peek(), "TABLE") {
                    tokens.next();
                    return Some(Insert {
                        verb,
                        target: name(&mut tokens),
                    });
                }
            }
            return Some(Insert { verb, target: None });
        }
        _ => return None,
    };
    while modifiers.iter().any(|m| is(tokens.peek(), m)) {
        tokens.next();
    }
    Some(Insert {
        verb,
        target: name(&mut tokens),
    })
}

/// A table's name, `table` or `database.table`, each part a word or quoted.
fn name<'a>(
    tokens: &mut std::iter::Peekable<impl Iterator<Item = Token<'a>>>,
) -> Option<(Option<String>, String)> {
    let part = |token: Option<Token<'_>>| match token? {
        Token::Word(w) => Some(w.to_string()),
        Token::Quoted(q) => Some(q),
        _ => None,
    };
    let first = part(tokens.next())?;
    if tokens.peek() != Some(&Token::Punct('.')) {
        return Some((None, first));
    }
    tokens.next();
    Some((Some(first), part(tokens.next())?))
}

/// Whether `statement`, logged with `schema` as its default database, inserts rows into
/// `database`.`table`: an INSERT, REPLACE or LOAD DATA whose target is that table, qualified
/// by its database or unqualified in it (names compared in any case). It says the
/// statement's verb and target, without its values (which may be the events' payloads):
/// `INSERT INTO shop.outbox`. A target that cannot be read counts where the table's name is
/// in the statement at all: better a false stop, which is said, than a lost event. An UPDATE
/// or DELETE logged so loses no event (they are not events), and passes.
pub(crate) fn logged_insert(
    statement: &str,
    schema: &str,
    database: &str,
    table: &str,
) -> Option<String> {
    let insert = insert(statement)?;
    let into = match insert.verb {
        "INSERT" | "REPLACE" => "INTO",
        _ => "… INTO TABLE",
    };
    let said = format!("{} {into} {database}.{table}", insert.verb);
    match insert.target {
        Some((qualifier, target)) => {
            let in_database = qualifier.as_deref().unwrap_or(schema);
            (target.eq_ignore_ascii_case(table) && in_database.eq_ignore_ascii_case(database))
                .then_some(said)
        }
        None => (!table.is_empty()
            && statement
                .to_ascii_lowercase()
                .contains(&table.to_ascii_lowercase()))
        .then_some(said),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(statement: &str, schema: &str) -> bool {
        logged_insert(statement, schema, "shop", "outbox").is_some()
    }

    #[test]
    fn an_insert_into_the_outbox_is_found_by_its_target_in_any_form() {
        for statement in [
            "INSERT INTO outbox (partition_key) VALUES ('a')",
            "insert into `outbox` values (1)",
            "INSERT INTO shop.outbox VALUES (1)",
            "INSERT INTO `Shop` . `OUTBOX` VALUES (1)",
            "INSERT outbox VALUES (1)",
            "INSERT LOW_PRIORITY IGNORE INTO outbox VALUES (1)",
            "INSERT HIGH_PRIORITY outbox SET partition_key = 'a'",
            "INSERT DELAYED INTO outbox VALUES (1)",
            "INSERT INTO outbox SELECT * FROM archive",
            "SET STATEMENT max_statement_time=5 FOR INSERT INTO outbox VALUES (1)",
            "set statement sql_mode = 'for', foreign_key_checks = (0) for replace outbox values (1)",
            "REPLACE outbox VALUES (1)",
            "REPLACE LOW_PRIORITY INTO `outbox` VALUES (1)",
            "  /* app */ REPLACE INTO outbox VALUES (1)",
            "INSERT /*+ SET_VAR(sort_buffer_size = 16M) */ INTO outbox VALUES (1)",
            "INSERT /*!50001 IGNORE */ INTO outbox VALUES (1)",
            "INSERT INTO outbox PARTITION (p0) VALUES (1)",
            "LOAD DATA INFILE '/tmp/x' INTO TABLE outbox",
            "LOAD DATA LOW_PRIORITY LOCAL INFILE '/tmp/into table other' REPLACE INTO TABLE \
             shop.outbox FIELDS TERMINATED BY ','",
            "load data concurrent local infile \"x\" ignore into table `outbox`",
            "LOAD XML LOCAL INFILE 'x.xml' INTO TABLE outbox",
        ] {
            assert!(stops(statement, "shop"), "{statement}");
        }
        assert!(
            stops("INSERT INTO shop.outbox VALUES (1)", "other"),
            "qualified by the outbox's database"
        );
        assert_eq!(
            logged_insert(
                "INSERT INTO outbox (payload) VALUES ('{\"card\": \"4111\"}')",
                "shop",
                "shop",
                "outbox"
            )
            .as_deref(),
            Some("INSERT INTO shop.outbox"),
            "the verb and target, not the values"
        );
        assert_eq!(
            logged_insert(
                "LOAD DATA INFILE 'x' INTO TABLE outbox",
                "shop",
                "shop",
                "outbox"
            )
            .as_deref(),
            Some("LOAD DATA … INTO TABLE shop.outbox")
        );
    }

    /// Statements that read the outbox, or name it in a value, a comment or a column, write
    /// no outbox row: pt-table-checksum's, run with its session's binlog_format STATEMENT,
    /// stopped capture for good.
    #[test]
    fn a_statement_that_names_the_outbox_elsewhere_than_its_target_passes() {
        for (statement, schema) in [
            (
                "REPLACE INTO `percona`.`checksums` (db, tbl, chunk, chunk_index, \
                 lower_boundary, upper_boundary, this_cnt, this_crc) SELECT 'shop', 'outbox', \
                 '1', NULL, NULL, NULL, COUNT(*) AS cnt, COALESCE(LOWER(CONV(BIT_XOR(CAST(\
                 CRC32(CONCAT_WS('#', `sequence_id`)) AS UNSIGNED)), 10, 16)), 0) AS crc FROM \
                 `shop`.`outbox` /*checksum table*/",
                "shop",
            ),
            ("INSERT INTO logs VALUES ('sent to outbox')", "shop"),
            (
                "SET STATEMENT sql_mode = '' FOR INSERT INTO logs VALUES (1)",
                "shop",
            ),
            ("INSERT INTO logs (outbox) VALUES (1)", "shop"),
            ("INSERT INTO archive SELECT * FROM outbox", "shop"),
            ("INSERT /* into outbox */ INTO archive VALUES (1)", "shop"),
            ("-- outbox\nINSERT INTO archive VALUES (1)", "shop"),
            ("LOAD DATA INFILE 'outbox' INTO TABLE archive", "shop"),
            ("LOAD INDEX INTO CACHE outbox", "shop"),
            ("INSERT INTO outbox VALUES (1)", "other"),
            ("INSERT INTO other.outbox VALUES (1)", "shop"),
            ("INSERT INTO outbox_parked VALUES (1)", "shop"),
            ("INSERT INTO my_outbox VALUES (1)", "shop"),
            ("DELETE FROM outbox WHERE sequence_id IN (1)", "shop"),
            ("UPDATE outbox SET x = 1", "shop"),
            ("CREATE TABLE outbox (id int)", "shop"),
            ("BEGIN", "shop"),
            ("COMMIT", "shop"),
        ] {
            assert!(!stops(statement, schema), "{statement} in {schema}");
        }
    }

    /// A statement that starts with a `--` or `#` comment read as having no verb, and was
    /// passed by; a double-quoted target (ANSI_QUOTES) was not read as the table.
    #[test]
    fn leading_comments_and_ansi_quoted_targets_are_read_past() {
        for statement in [
            "-- app: order 17\nINSERT INTO outbox VALUES (1)",
            "--\tapp\r\nINSERT INTO outbox VALUES (1)",
            "# app\nINSERT INTO outbox VALUES (1)",
            "/* a */ -- b\n# c\n/* d */INSERT INTO outbox VALUES (1)",
            "INSERT INTO \"shop\".\"outbox\" VALUES (1)",
            "INSERT INTO \"outbox\" VALUES (1)",
            "REPLACE INTO shop.\"OUTBOX\" VALUES (1)",
        ] {
            assert!(stops(statement, "shop"), "{statement}");
        }
        // `--` without a blank after it is two minus signs, not a comment.
        assert!(insert("--1").is_none());
        assert!(!stops(
            "INSERT INTO \"other\".\"outbox\" VALUES (1)",
            "shop"
        ));
    }

    #[test]
    fn a_target_that_cannot_be_read_counts_where_the_table_is_named() {
        assert!(stops("INSERT INTO (outbox) VALUES (1)", "shop"));
        assert!(!stops("INSERT INTO (archive) VALUES (1)", "shop"));
        assert!(stops("INSERT INTO outbox VALUES ('unterminated", "shop"));
        assert!(stops("INSERT /* unterminated outbox", "shop"));
    }
}
