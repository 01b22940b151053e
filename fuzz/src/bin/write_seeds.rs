//! Writes the seed corpus: `write_seeds <fuzz/corpus>` (scripts/fuzz.sh --seeds runs it).
fn main() -> std::io::Result<()> {
    let dir = std::env::args_os()
        .nth(1)
        .unwrap_or_else(|| "fuzz/corpus".into());
    adsrelay_fuzz::seeds::write_all(std::path::Path::new(&dir))
}
