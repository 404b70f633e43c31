//! Checks GGUF vocabularies against llama.cpp's tokenizer test files: for
//! each `NAME.gguf` given, the texts of `NAME.gguf.inp` (separated by
//! `__ggml_vocab_test__` lines) are tokenized without special tokens and
//! compared with the ids of `NAME.gguf.out` (one line per text), which
//! llama.cpp's repository ships beside its vocabulary-only GGUFs
//! (`models/ggml-vocab-*.gguf`), made with each model's Hugging Face
//! tokenizer.
//!
//! `cargo run --release -p granary-tokenizer --example vocab_check -- DIR/ggml-vocab-*.gguf`

use std::path::Path;

use granary_tokenizer::Tokenizer;

fn main() {
    let mut all_ok = true;
    for arg in std::env::args().skip(1) {
        let path = Path::new(&arg);
        let inp = std::fs::read_to_string(format!("{arg}.inp"));
        let out = std::fs::read_to_string(format!("{arg}.out"));
        let (Ok(inp), Ok(out)) = (inp, out) else {
            println!("{:<36} no .inp/.out beside it", name(path));
            continue;
        };
        let tok = match Tokenizer::from_gguf_path(path) {
            Ok(t) => t,
            Err(e) => {
                println!("{:<36} refused: {e}", name(path));
                all_ok = false;
                continue;
            }
        };
        let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
        let texts = &texts[..texts.len() - 1];
        let wants: Vec<Vec<u32>> =
            out.lines().map(|l| l.split_whitespace().map(|t| t.parse().expect("token id")).collect()).collect();
        assert_eq!(texts.len(), wants.len(), "{arg}: {} texts, {} id lines", texts.len(), wants.len());
        let mut wrong = Vec::new();
        for (text, want) in texts.iter().zip(&wants) {
            match tok.encode(text, false) {
                Ok(got) if &got == want => {}
                Ok(got) => wrong.push(format!("    {text:?}: {got:?}, expected {want:?}")),
                Err(e) => wrong.push(format!("    {text:?}: error {e}")),
            }
        }
        let family = tok.pre_tokenizer().unwrap_or("-");
        println!(
            "{:<36} pre-tokenizer {family:<14} {} of {} texts as llama.cpp's reference",
            name(path),
            texts.len() - wrong.len(),
            texts.len()
        );
        for w in wrong.iter().take(3) {
            println!("{w}");
        }
        all_ok &= wrong.is_empty();
    }
    std::process::exit(if all_ok { 0 } else { 1 });
}

fn name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}
