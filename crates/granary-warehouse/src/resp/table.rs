//! The RESP commands the server knows: name, arity and who may run them.
//!
//! [`Session`](super::Session) checks every command against this table
//! before running it (and before queueing it inside MULTI), so arity,
//! authentication and admin rights are decided in one place and a queued
//! command fails at MULTI time exactly as Redis's would.

/// Runs before AUTH (AUTH, HELLO, QUIT).
pub const NO_AUTH: u8 = 1;
/// Only the admin token may run it.
pub const ADMIN: u8 = 2;
/// Refused inside MULTI (Redis's `no-multi`): the transaction is aborted.
pub const NO_MULTI: u8 = 4;
/// Transaction control: runs at once inside MULTI instead of being queued.
pub const TX: u8 = 8;

/// One command. `arity` counts the name, as Redis's does: `n` means
/// exactly `n` words, `-n` at least `n`.
#[derive(Debug)]
pub struct CommandSpec {
    /// Lower case, as Redis's error texts quote it.
    pub name: &'static str,
    pub arity: i32,
    pub flags: u8,
}

impl CommandSpec {
    pub fn arity_ok(&self, words: usize) -> bool {
        let words = words as i64;
        let a = i64::from(self.arity);
        if a >= 0 {
            words == a
        } else {
            words >= -a
        }
    }

    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

const fn c(name: &'static str, arity: i32, flags: u8) -> CommandSpec {
    CommandSpec { name, arity, flags }
}

/// Every command the server answers.
pub static COMMANDS: &[CommandSpec] = &[
    c("auth", -2, NO_AUTH | NO_MULTI),
    c("hello", -1, NO_AUTH | NO_MULTI),
    c("quit", -1, NO_AUTH | TX),
    c("reset", 1, TX),
    c("multi", 1, TX),
    c("exec", 1, TX),
    c("discard", 1, TX),
    c("watch", -2, NO_MULTI),
    c("unwatch", 1, 0),
    c("ping", -1, 0),
    c("echo", 2, 0),
    c("select", 2, 0),
    c("client", -2, 0),
    c("namespace", -1, 0),
    c("get", 2, 0),
    c("getex", -2, 0),
    c("getdel", 2, 0),
    c("set", -3, 0),
    c("setex", 4, 0),
    c("psetex", 4, 0),
    c("setnx", 3, 0),
    c("mget", -2, 0),
    c("mset", -3, 0),
    c("exists", -2, 0),
    c("del", -2, 0),
    c("unlink", -2, 0),
    c("strlen", 2, 0),
    c("type", 2, 0),
    c("expire", -3, 0),
    c("pexpire", -3, 0),
    c("expireat", -3, 0),
    c("pexpireat", -3, 0),
    c("persist", 2, 0),
    c("ttl", 2, 0),
    c("pttl", 2, 0),
    c("scan", -2, 0),
    c("keys", 2, 0),
    c("dbsize", 1, 0),
    c("info", -1, 0),
    c("config", -2, 0),
    c("flushdb", -1, ADMIN),
    c("flushall", -1, ADMIN),
    c("command", -1, 0),
    c("waitaof", 4, 0),
    c("wait", 3, 0),
    c("readonly", 1, 0),
    c("readwrite", 1, 0),
];

/// The entry for a command name, in any case.
pub fn lookup(name: &[u8]) -> Option<&'static CommandSpec> {
    COMMANDS.iter().find(|c| c.name.as_bytes().eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_lower_case() {
        for (i, a) in COMMANDS.iter().enumerate() {
            assert_eq!(a.name, a.name.to_ascii_lowercase());
            assert!(COMMANDS[i + 1..].iter().all(|b| b.name != a.name), "{} twice", a.name);
        }
        assert_eq!(lookup(b"GeT").unwrap().name, "get");
        assert!(lookup(b"nosuch").is_none());
        assert!(lookup(b"set").unwrap().arity_ok(3));
        assert!(!lookup(b"get").unwrap().arity_ok(3));
    }
}
