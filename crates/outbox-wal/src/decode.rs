//! The pgoutput decoder: logical replication messages of protocol version 1 (with `messages
//! 'true'`), parsed from the bytes of one `XLogData` payload. Pure: no I/O, no allocation
//! beyond the column lists, and every value borrows from the input.
//!
//! The wire format is PostgreSQL's "Logical Replication Message Formats" chapter. Integers
//! are big-endian; a `String` is NUL-terminated; an LSN is an `Int64`; a timestamp is
//! microseconds since 2000-01-01 UTC. Version 1 carries no transaction id in change messages
//! (that comes with streaming, version 2), so a message that only streaming sends is refused
//! as [`DecodeError::Unsupported`].
//!
//! Decoding never panics: a short, overlong or malformed input is a [`DecodeError`] naming
//! the message and the field.

use crate::lsn::Lsn;

/// One decoded pgoutput message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogicalMessage<'a> {
    Begin(Begin),
    Commit(Commit),
    Origin(Origin<'a>),
    Relation(Relation<'a>),
    Type(TypeMessage<'a>),
    Insert(Insert<'a>),
    Update(Update<'a>),
    Delete(Delete<'a>),
    Truncate(Truncate),
    Message(EmittedMessage<'a>),
}

/// `B`: a transaction starts. Without streaming, pgoutput sends a transaction only once it
/// has committed, so `final_lsn` (the commit record's position) is already known here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Begin {
    pub final_lsn: Lsn,
    /// Microseconds since 2000-01-01 UTC.
    pub commit_time: i64,
    pub xid: u32,
}

/// `C`: the transaction's last message. `end_lsn` is the position to confirm once every
/// event of the transaction is safe: a slot confirmed there never sends it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Commit {
    /// Unused by PostgreSQL so far (always 0).
    pub flags: u8,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    /// Microseconds since 2000-01-01 UTC.
    pub commit_time: i64,
}

/// `O`: the transaction was replicated from another node (`origin`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origin<'a> {
    pub commit_lsn: Lsn,
    pub name: &'a str,
}

/// `R`: a table's shape, sent before its first change in a session and after every change
/// of its definition. Column values in tuples follow `columns` by position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relation<'a> {
    pub oid: u32,
    /// Empty for `pg_catalog`.
    pub namespace: &'a str,
    pub name: &'a str,
    /// `d` default, `n` nothing, `f` full, `i` index.
    pub replica_identity: u8,
    pub columns: Vec<RelationColumn<'a>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RelationColumn<'a> {
    /// Part of the replica identity key.
    pub key: bool,
    pub name: &'a str,
    pub type_oid: u32,
    pub type_modifier: i32,
}

/// `Y`: a non-built-in type a relation uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeMessage<'a> {
    pub oid: u32,
    pub namespace: &'a str,
    pub name: &'a str,
}

/// `I`: a new row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Insert<'a> {
    pub relation: u32,
    pub new: TupleData<'a>,
}

/// Which old row an update or delete carries: its key columns, or the whole row
/// (`REPLICA IDENTITY FULL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OldRow {
    Key,
    Full,
}

/// `U`: a changed row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Update<'a> {
    pub relation: u32,
    pub old: Option<(OldRow, TupleData<'a>)>,
    pub new: TupleData<'a>,
}

/// `D`: a deleted row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delete<'a> {
    pub relation: u32,
    pub old: (OldRow, TupleData<'a>),
}

/// `T`: tables emptied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Truncate {
    /// Bit 1: CASCADE; bit 2: RESTART IDENTITY.
    pub options: u8,
    pub relations: Vec<u32>,
}

/// `M`: a logical decoding message (`pg_logical_emit_message`). A transactional one is
/// sent inside its transaction's Begin and Commit, and only if that transaction committed;
/// a non-transactional one is sent at once, outside any transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmittedMessage<'a> {
    pub transactional: bool,
    pub lsn: Lsn,
    pub prefix: &'a str,
    pub content: &'a [u8],
}

/// A row's column values, in the order of its relation's columns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TupleData<'a> {
    pub columns: Vec<ColumnValue<'a>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColumnValue<'a> {
    Null,
    /// A TOASTed value the change did not touch; its content is not in the WAL record.
    UnchangedToast,
    /// The type's text output.
    Text(&'a [u8]),
    /// The type's binary send format (only with `binary 'true'`).
    Binary(&'a [u8]),
}

/// Bytes that are not a pgoutput version 1 message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty pgoutput message")]
    Empty,
    #[error("pgoutput message type {tag:?} is unknown to protocol version 1")]
    UnknownTag { tag: char },
    #[error(
        "pgoutput {what} messages are not expected with protocol version 1 and no streaming or two-phase option"
    )]
    Unsupported { what: &'static str },
    #[error("pgoutput {message} message ends inside its {field}")]
    Truncated {
        message: &'static str,
        field: &'static str,
    },
    #[error("pgoutput {message} message has {count} bytes after its last field")]
    TrailingBytes { message: &'static str, count: usize },
    #[error("pgoutput {message} message: {field} is not UTF-8")]
    NotUtf8 {
        message: &'static str,
        field: &'static str,
    },
    #[error("pgoutput {message} message: invalid {field}: {detail}")]
    Invalid {
        message: &'static str,
        field: &'static str,
        detail: String,
    },
}

/// Decodes one pgoutput message.
pub fn decode(bytes: &[u8]) -> Result<LogicalMessage<'_>, DecodeError> {
    let (&tag, body) = bytes.split_first().ok_or(DecodeError::Empty)?;
    let message = match tag {
        b'B' => "Begin",
        b'C' => "Commit",
        b'O' => "Origin",
        b'R' => "Relation",
        b'Y' => "Type",
        b'I' => "Insert",
        b'U' => "Update",
        b'D' => "Delete",
        b'T' => "Truncate",
        b'M' => "Message",
        b'S' | b'E' | b'c' | b'A' => return Err(DecodeError::Unsupported { what: "stream" }),
        b'b' | b'P' | b'K' | b'r' | b'p' => {
            return Err(DecodeError::Unsupported { what: "two-phase" })
        }
        other => {
            return Err(DecodeError::UnknownTag {
                tag: char::from(other),
            })
        }
    };
    let mut r = Reader {
        rest: body,
        message,
    };
    let decoded = match tag {
        b'B' => LogicalMessage::Begin(Begin {
            final_lsn: r.lsn("final LSN")?,
            commit_time: r.i64("commit timestamp")?,
            xid: r.u32("transaction id")?,
        }),
        b'C' => LogicalMessage::Commit(Commit {
            flags: r.u8("flags")?,
            commit_lsn: r.lsn("commit LSN")?,
            end_lsn: r.lsn("end LSN")?,
            commit_time: r.i64("commit timestamp")?,
        }),
        b'O' => LogicalMessage::Origin(Origin {
            commit_lsn: r.lsn("origin commit LSN")?,
            name: r.string("origin name")?,
        }),
        b'R' => LogicalMessage::Relation(relation_body(&mut r)?),
        b'Y' => LogicalMessage::Type(TypeMessage {
            oid: r.u32("type OID")?,
            namespace: r.string("namespace")?,
            name: r.string("type name")?,
        }),
        b'I' => {
            let relation = r.u32("relation OID")?;
            match r.u8("tuple kind")? {
                b'N' => LogicalMessage::Insert(Insert {
                    relation,
                    new: tuple_data(&mut r)?,
                }),
                other => return Err(r.invalid("tuple kind", format!("{:?}", char::from(other)))),
            }
        }
        b'U' => {
            let relation = r.u32("relation OID")?;
            let (old, new) = match r.u8("tuple kind")? {
                b'N' => (None, tuple_data(&mut r)?),
                kind @ (b'K' | b'O') => {
                    let old = (old_row(kind), tuple_data(&mut r)?);
                    match r.u8("new tuple kind")? {
                        b'N' => (Some(old), tuple_data(&mut r)?),
                        other => {
                            return Err(
                                r.invalid("new tuple kind", format!("{:?}", char::from(other)))
                            )
                        }
                    }
                }
                other => return Err(r.invalid("tuple kind", format!("{:?}", char::from(other)))),
            };
            LogicalMessage::Update(Update { relation, old, new })
        }
        b'D' => {
            let relation = r.u32("relation OID")?;
            match r.u8("tuple kind")? {
                kind @ (b'K' | b'O') => LogicalMessage::Delete(Delete {
                    relation,
                    old: (old_row(kind), tuple_data(&mut r)?),
                }),
                other => return Err(r.invalid("tuple kind", format!("{:?}", char::from(other)))),
            }
        }
        b'T' => {
            let count = r.count32("relation count")?;
            let options = r.u8("options")?;
            // Four bytes per relation: a count larger than the input is refused before any
            // allocation is sized by it.
            let mut relations = Vec::with_capacity(count.min(r.rest.len() / 4));
            for _ in 0..count {
                relations.push(r.u32("relation OID")?);
            }
            LogicalMessage::Truncate(Truncate { options, relations })
        }
        // Only `b'M'` is left: the tags were matched above.
        _ => {
            let flags = r.u8("flags")?;
            let lsn = r.lsn("message LSN")?;
            let prefix = r.string("prefix")?;
            let length = r.count32("content length")?;
            LogicalMessage::Message(EmittedMessage {
                transactional: flags & 1 == 1,
                lsn,
                prefix,
                content: r.bytes(length, "content")?,
            })
        }
    };
    if !r.rest.is_empty() {
        return Err(DecodeError::TrailingBytes {
            message,
            count: r.rest.len(),
        });
    }
    Ok(decoded)
}

fn old_row(kind: u8) -> OldRow {
    if kind == b'K' {
        OldRow::Key
    } else {
        OldRow::Full
    }
}

fn relation_body<'a>(r: &mut Reader<'a>) -> Result<Relation<'a>, DecodeError> {
    let oid = r.u32("relation OID")?;
    let namespace = r.string("namespace")?;
    let name = r.string("relation name")?;
    let replica_identity = r.u8("replica identity")?;
    let count = r.count16("column count")?;
    // Each column takes at least 10 bytes (flags, an empty name, type OID, modifier).
    let mut columns = Vec::with_capacity(count.min(r.rest.len() / 10));
    for _ in 0..count {
        columns.push(RelationColumn {
            key: r.u8("column flags")? & 1 == 1,
            name: r.string("column name")?,
            type_oid: r.u32("column type OID")?,
            type_modifier: r.i32("column type modifier")?,
        });
    }
    Ok(Relation {
        oid,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn tuple_data<'a>(r: &mut Reader<'a>) -> Result<TupleData<'a>, DecodeError> {
    let count = r.count16("tuple column count")?;
    let mut columns = Vec::with_capacity(count.min(r.rest.len()));
    for _ in 0..count {
        columns.push(match r.u8("column kind")? {
            b'n' => ColumnValue::Null,
            b'u' => ColumnValue::UnchangedToast,
            b't' => {
                let length = r.count32("column length")?;
                ColumnValue::Text(r.bytes(length, "column value")?)
            }
            b'b' => {
                let length = r.count32("column length")?;
                ColumnValue::Binary(r.bytes(length, "column value")?)
            }
            other => return Err(r.invalid("column kind", format!("{:?}", char::from(other)))),
        });
    }
    Ok(TupleData { columns })
}

/// A cursor over one message's body.
struct Reader<'a> {
    rest: &'a [u8],
    message: &'static str,
}

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let (head, tail) = self
            .rest
            .split_first_chunk::<N>()
            .ok_or(self.truncated(field))?;
        self.rest = tail;
        Ok(*head)
    }

    fn truncated(&self, field: &'static str) -> DecodeError {
        DecodeError::Truncated {
            message: self.message,
            field,
        }
    }

    fn invalid(&self, field: &'static str, detail: String) -> DecodeError {
        DecodeError::Invalid {
            message: self.message,
            field,
            detail,
        }
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take::<1>(field)?[0])
    }

    fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.take(field)?))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(field)?))
    }

    fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.take(field)?))
    }

    fn lsn(&mut self, field: &'static str) -> Result<Lsn, DecodeError> {
        Ok(Lsn(u64::from_be_bytes(self.take(field)?)))
    }

    /// An `Int16` count; negative is malformed.
    fn count16(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let n = i16::from_be_bytes(self.take(field)?);
        usize::try_from(n).map_err(|_| self.invalid(field, n.to_string()))
    }

    /// An `Int32` count or length; negative is malformed.
    fn count32(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let n = self.i32(field)?;
        usize::try_from(n).map_err(|_| self.invalid(field, n.to_string()))
    }

    fn bytes(&mut self, length: usize, field: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.rest.len() < length {
            return Err(self.truncated(field));
        }
        let (head, tail) = self.rest.split_at(length);
        self.rest = tail;
        Ok(head)
    }

    fn string(&mut self, field: &'static str) -> Result<&'a str, DecodeError> {
        let end = self
            .rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(self.truncated(field))?;
        let text = std::str::from_utf8(&self.rest[..end]).map_err(|_| DecodeError::NotUtf8 {
            message: self.message,
            field,
        })?;
        self.rest = &self.rest[end + 1..];
        Ok(text)
    }
}

/// Builders of wire messages, for tests here and in the assembler.
#[cfg(test)]
pub(crate) mod wire {
    pub fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    pub fn begin(final_lsn: u64, commit_time: i64, xid: u32) -> Vec<u8> {
        let mut out = vec![b'B'];
        out.extend_from_slice(&final_lsn.to_be_bytes());
        out.extend_from_slice(&commit_time.to_be_bytes());
        out.extend_from_slice(&xid.to_be_bytes());
        out
    }

    pub fn commit(commit_lsn: u64, end_lsn: u64, commit_time: i64) -> Vec<u8> {
        let mut out = vec![b'C', 0];
        out.extend_from_slice(&commit_lsn.to_be_bytes());
        out.extend_from_slice(&end_lsn.to_be_bytes());
        out.extend_from_slice(&commit_time.to_be_bytes());
        out
    }

    pub fn relation(oid: u32, namespace: &str, name: &str, columns: &[(&str, u32)]) -> Vec<u8> {
        let mut out = vec![b'R'];
        out.extend_from_slice(&oid.to_be_bytes());
        string(&mut out, namespace);
        string(&mut out, name);
        out.push(b'd');
        out.extend_from_slice(&(columns.len() as i16).to_be_bytes());
        for (i, (column, type_oid)) in columns.iter().enumerate() {
            out.push(u8::from(i == 0));
            string(&mut out, column);
            out.extend_from_slice(&type_oid.to_be_bytes());
            out.extend_from_slice(&(-1i32).to_be_bytes());
        }
        out
    }

    pub fn tuple(out: &mut Vec<u8>, values: &[Option<&str>]) {
        out.extend_from_slice(&(values.len() as i16).to_be_bytes());
        for value in values {
            match value {
                None => out.push(b'n'),
                Some(text) => {
                    out.push(b't');
                    out.extend_from_slice(&(text.len() as i32).to_be_bytes());
                    out.extend_from_slice(text.as_bytes());
                }
            }
        }
    }

    pub fn insert(relation: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut out = vec![b'I'];
        out.extend_from_slice(&relation.to_be_bytes());
        out.push(b'N');
        tuple(&mut out, values);
        out
    }

    pub fn message(transactional: bool, lsn: u64, prefix: &str, content: &[u8]) -> Vec<u8> {
        let mut out = vec![b'M', u8::from(transactional)];
        out.extend_from_slice(&lsn.to_be_bytes());
        string(&mut out, prefix);
        out.extend_from_slice(&(content.len() as i32).to_be_bytes());
        out.extend_from_slice(content);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::wire::*;
    use super::*;

    fn every_kind_of_message() -> Vec<Vec<u8>> {
        let mut update = vec![b'U'];
        update.extend_from_slice(&7u32.to_be_bytes());
        update.push(b'K');
        tuple(&mut update, &[Some("1")]);
        update.push(b'N');
        update.extend_from_slice(&2i16.to_be_bytes());
        update.extend_from_slice(b"t\0\0\0\x012u");
        let mut delete = vec![b'D'];
        delete.extend_from_slice(&7u32.to_be_bytes());
        delete.push(b'O');
        tuple(&mut delete, &[Some("1"), None]);
        let mut truncate = vec![b'T'];
        truncate.extend_from_slice(&2i32.to_be_bytes());
        truncate.push(1);
        truncate.extend_from_slice(&7u32.to_be_bytes());
        truncate.extend_from_slice(&8u32.to_be_bytes());
        let mut origin = vec![b'O'];
        origin.extend_from_slice(&9u64.to_be_bytes());
        string(&mut origin, "node_a");
        let mut type_message = vec![b'Y'];
        type_message.extend_from_slice(&16385u32.to_be_bytes());
        string(&mut type_message, "public");
        string(&mut type_message, "mood");
        vec![
            begin(0x10, 5, 42),
            relation(
                7,
                "public",
                "outbox",
                &[("sequence_id", 20), ("payload", 3802)],
            ),
            insert(7, &[Some("1"), None]),
            update,
            delete,
            truncate,
            origin,
            type_message,
            message(true, 0x11, "outbox", b"{}"),
            commit(0x10, 0x20, 5),
        ]
    }

    #[test]
    fn decodes_every_message_of_protocol_version_1() {
        let all = every_kind_of_message();
        let decoded: Vec<_> = all.iter().map(|m| decode(m).unwrap()).collect();
        assert_eq!(
            decoded[0],
            LogicalMessage::Begin(Begin {
                final_lsn: Lsn(0x10),
                commit_time: 5,
                xid: 42
            })
        );
        let LogicalMessage::Relation(rel) = &decoded[1] else {
            panic!("{:?}", decoded[1])
        };
        assert_eq!((rel.oid, rel.namespace, rel.name), (7, "public", "outbox"));
        assert_eq!(rel.columns[0].name, "sequence_id");
        assert!(rel.columns[0].key && !rel.columns[1].key);
        assert_eq!(rel.columns[1].type_oid, 3802);
        assert_eq!(
            decoded[2],
            LogicalMessage::Insert(Insert {
                relation: 7,
                new: TupleData {
                    columns: vec![ColumnValue::Text(b"1"), ColumnValue::Null]
                }
            })
        );
        let LogicalMessage::Update(update) = &decoded[3] else {
            panic!("{:?}", decoded[3])
        };
        assert_eq!(update.old.as_ref().unwrap().0, OldRow::Key);
        assert_eq!(
            update.new.columns,
            vec![ColumnValue::Text(b"2"), ColumnValue::UnchangedToast]
        );
        let LogicalMessage::Delete(delete) = &decoded[4] else {
            panic!("{:?}", decoded[4])
        };
        assert_eq!(delete.old.0, OldRow::Full);
        assert_eq!(
            decoded[5],
            LogicalMessage::Truncate(Truncate {
                options: 1,
                relations: vec![7, 8]
            })
        );
        assert_eq!(
            decoded[6],
            LogicalMessage::Origin(Origin {
                commit_lsn: Lsn(9),
                name: "node_a"
            })
        );
        assert_eq!(
            decoded[7],
            LogicalMessage::Type(TypeMessage {
                oid: 16385,
                namespace: "public",
                name: "mood"
            })
        );
        assert_eq!(
            decoded[8],
            LogicalMessage::Message(EmittedMessage {
                transactional: true,
                lsn: Lsn(0x11),
                prefix: "outbox",
                content: b"{}"
            })
        );
        assert_eq!(
            decoded[9],
            LogicalMessage::Commit(Commit {
                flags: 0,
                commit_lsn: Lsn(0x10),
                end_lsn: Lsn(0x20),
                commit_time: 5
            })
        );
    }

    #[test]
    fn malformed_messages_are_typed_errors() {
        assert_eq!(decode(b""), Err(DecodeError::Empty));
        assert_eq!(decode(b"Z"), Err(DecodeError::UnknownTag { tag: 'Z' }));
        assert_eq!(
            decode(b"S\0\0\0\x01\x01"),
            Err(DecodeError::Unsupported { what: "stream" })
        );
        assert!(matches!(
            decode(b"B\0\0"),
            Err(DecodeError::Truncated {
                message: "Begin",
                field: "final LSN"
            })
        ));
        let mut long = begin(1, 2, 3);
        long.push(0);
        assert_eq!(
            decode(&long),
            Err(DecodeError::TrailingBytes {
                message: "Begin",
                count: 1
            })
        );
        let mut negative = vec![b'I', 0, 0, 0, 7, b'N'];
        negative.extend_from_slice(&1i16.to_be_bytes());
        negative.push(b't');
        negative.extend_from_slice(&(-5i32).to_be_bytes());
        assert!(matches!(
            decode(&negative),
            Err(DecodeError::Invalid {
                field: "column length",
                ..
            })
        ));
        let mut not_utf8 = vec![b'O'];
        not_utf8.extend_from_slice(&1u64.to_be_bytes());
        not_utf8.extend_from_slice(&[0xff, 0xfe, 0]);
        assert_eq!(
            decode(&not_utf8),
            Err(DecodeError::NotUtf8 {
                message: "Origin",
                field: "origin name"
            })
        );
    }

    /// Every prefix of every valid message, every valid message with bytes flipped, and
    /// random byte strings: each decodes or is refused, and none panics.
    #[test]
    fn no_byte_string_makes_the_decoder_panic() {
        let mut rng = fastrand::Rng::with_seed(0x5eed);
        let valid = every_kind_of_message();
        for message in &valid {
            for cut in 0..message.len() {
                assert!(decode(&message[..cut]).is_err(), "{:?}", &message[..cut]);
            }
            for _ in 0..2_000 {
                let mut mutated = message.clone();
                for _ in 0..rng.usize(1..4) {
                    let at = rng.usize(..mutated.len());
                    mutated[at] = rng.u8(..);
                }
                let _ = decode(&mutated);
            }
        }
        let tags = b"BCORYIUDTMSEcAbPKrpZ";
        for _ in 0..50_000 {
            let mut bytes: Vec<u8> = (0..rng.usize(0..64)).map(|_| rng.u8(..)).collect();
            if let Some(first) = bytes.first_mut() {
                *first = tags[rng.usize(..tags.len())];
            }
            let _ = decode(&bytes);
        }
    }
}
