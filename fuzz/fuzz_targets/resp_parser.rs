//! Feeds arbitrary bytes to the RESP request parser, whole and in two
//! pieces: it must never panic, must consume only what it returns, and
//! must give the same commands however the input is split.
#![no_main]

use bytes::BytesMut;
use granary_warehouse::resp::{parse_command, Limits, Parse};
use libfuzzer_sys::fuzz_target;

fn run(chunks: &[&[u8]], limits: &Limits) -> (Vec<Vec<bytes::Bytes>>, bool) {
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.len();
            match parse_command(&mut buf, limits) {
                Ok(Parse::Command(c)) => {
                    assert!(buf.len() < before, "a command must consume input");
                    out.push(c);
                }
                Ok(Parse::Incomplete { need }) => {
                    assert!(need > buf.len(), "incomplete must ask for more bytes");
                    assert_eq!(buf.len(), before, "incomplete must consume nothing");
                    break;
                }
                Err(_) => return (out, true),
            }
        }
    }
    (out, false)
}

fuzz_target!(|data: &[u8]| {
    let limits = Limits { max_bulk: 4096, max_args: 64, max_inline: 1024, max_frame: 16 * 1024 };
    let (whole, whole_err) = run(&[data], &limits);
    if data.is_empty() {
        return;
    }
    let split = usize::from(data[0]) % data.len();
    let (parts, parts_err) = run(&[&data[..split], &data[split..]], &limits);
    if !whole_err && !parts_err {
        assert_eq!(whole, parts, "splitting the input changed the commands");
    }
});
