//! Real English prose for teacher-forced scoring: the `*.txt` files of a directory (as written by
//! `scripts/fetch-prose.sh` into `data/prose/`), normalised and cut into documents of a token range.
//!
//! Synthetic tasks measure retrieval; prose measures whether a policy keeps what ordinary language modelling
//! needs, so the text must be real and the documents long enough to overflow the cache budgets being compared.
//!
//! Normalisation: line endings become `\n`, paragraphs are blank-line separated, and each paragraph is reflowed
//! onto one line with runs of whitespace collapsed. The source texts are hard-wrapped at 70 columns with
//! typewriter double spaces; that is typesetting, not language, and keeping it would make the scored model spend
//! its predictions on line breaks. Paragraphs without a letter (rules of asterisks and the like) are dropped.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::EvalError;

/// One prose document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// `<file stem>:<index>`, stable across runs, so that per-document results can be compared.
    pub name: String,
    /// Paragraphs separated by blank lines.
    pub text: String,
}

/// Largest single file read; a few MB of prose is plenty, and a larger file is more likely a mistake.
pub const MAX_FILE_BYTES: u64 = 16 << 20;
/// Largest total read from one directory.
pub const MAX_TOTAL_BYTES: u64 = 64 << 20;
/// Most `*.txt` files read from one directory.
pub const MAX_FILES: usize = 256;
/// Largest `min_tokens` accepted; documents longer than this would not fit any model we serve.
pub const MAX_MIN_TOKENS: usize = 1 << 20;

/// The input bounds, separate so tests can exercise them without writing megabytes.
#[derive(Debug, Clone, Copy)]
struct Limits {
    file_bytes: u64,
    total_bytes: u64,
    files: usize,
}

const LIMITS: Limits = Limits { file_bytes: MAX_FILE_BYTES, total_bytes: MAX_TOTAL_BYTES, files: MAX_FILES };

/// Loads every `*.txt` file in `dir` (not recursing), in file-name order, and splits each at paragraph boundaries
/// into documents of about `min_tokens..2 * min_tokens` tokens as measured by `count_tokens`. Documents never
/// span files. A file's leftover tail shorter than `min_tokens` joins the file's last document when the result stays
/// under `2 * min_tokens`, and is dropped otherwise. A paragraph longer than `min_tokens` is cut at sentence ends,
/// and a sentence longer than that at spaces.
///
/// Errors when the directory cannot be read, a file is not UTF-8, an input bound is exceeded, or no document
/// results.
pub fn load_documents(
    dir: &Path,
    min_tokens: usize,
    count_tokens: &dyn Fn(&str) -> usize,
) -> Result<Vec<Document>, EvalError> {
    load_with(dir, min_tokens, count_tokens, LIMITS)
}

fn load_with(
    dir: &Path,
    min_tokens: usize,
    count_tokens: &dyn Fn(&str) -> usize,
    limits: Limits,
) -> Result<Vec<Document>, EvalError> {
    if min_tokens == 0 || min_tokens > MAX_MIN_TOKENS {
        return Err(EvalError::InvalidArgument(format!(
            "min_tokens must be in 1..={MAX_MIN_TOKENS}, got {min_tokens}"
        )));
    }
    let files = text_files(dir, limits.files)?;
    let sep_tokens = count_tokens(PARAGRAPH_SEP);
    let mut total = 0u64;
    let mut docs = Vec::new();
    for path in files {
        let text = read_bounded(&path, limits.file_bytes)?;
        total += text.len() as u64;
        if total > limits.total_bytes {
            return Err(EvalError::TooMuchText {
                dir: dir.to_path_buf(),
                reason: format!("over {} bytes in all", limits.total_bytes),
            });
        }
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let paragraphs = paragraphs(&text);
        docs.extend(split_documents(&stem, &paragraphs, min_tokens, sep_tokens, count_tokens));
    }
    if docs.is_empty() {
        return Err(EvalError::NoDocuments { dir: dir.to_path_buf(), min_tokens });
    }
    Ok(docs)
}

const PARAGRAPH_SEP: &str = "\n\n";

/// The `*.txt` regular files (symlinks followed) directly in `dir`, sorted by name for a deterministic order.
fn text_files(dir: &Path, max_files: usize) -> Result<Vec<PathBuf>, EvalError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| EvalError::Io { path, source }
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.extension().is_none_or(|e| e != "txt") {
            continue;
        }
        if !std::fs::metadata(&path).map_err(io(&path))?.is_file() {
            continue;
        }
        if files.len() == max_files {
            return Err(EvalError::TooMuchText {
                dir: dir.to_path_buf(),
                reason: format!("more than {max_files} .txt files"),
            });
        }
        files.push(path);
    }
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    Ok(files)
}

/// Reads a UTF-8 file of at most `limit` bytes. Reads through `take` as well as checking the size up front, so a
/// file that grows while being read is still bounded.
fn read_bounded(path: &Path, limit: u64) -> Result<String, EvalError> {
    let io = |source| EvalError::Io { path: path.to_path_buf(), source };
    let too_large = || EvalError::FileTooLarge { path: path.to_path_buf(), limit };
    let file = std::fs::File::open(path).map_err(io)?;
    if file.metadata().map_err(io)?.len() > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    String::from_utf8(bytes).map_err(|_| EvalError::NotUtf8 { path: path.to_path_buf() })
}

/// Blank-line separated paragraphs, each reflowed onto one line with whitespace collapsed; paragraphs without a
/// letter are dropped.
fn paragraphs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    let mut flush = |current: &mut Vec<&str>| {
        let para = current.iter().flat_map(|l| l.split_whitespace()).collect::<Vec<_>>().join(" ");
        if para.chars().any(char::is_alphabetic) {
            out.push(para);
        }
        current.clear();
    };
    // `lines` strips a trailing `\r` too, so CRLF files need no separate pass.
    for line in text.lines() {
        if line.trim().is_empty() {
            flush(&mut current);
        } else {
            current.push(line);
        }
    }
    flush(&mut current);
    out
}

/// Cuts a paragraph longer than `max_tokens` into pieces of at most that many tokens where possible: at sentence
/// ends, and a single over-long sentence at spaces (by a word-count estimate, so that piece is approximate).
fn pieces(para: &str, tokens: usize, max_tokens: usize, count: &dyn Fn(&str) -> usize) -> Vec<(String, usize)> {
    if tokens <= max_tokens {
        return vec![(para.to_string(), tokens)];
    }
    let mut sentences: Vec<String> = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for word in para.split(' ') {
        current.push(word);
        let end = word.trim_end_matches(['\'', '"', ')', ']', '\u{2019}', '\u{201d}']);
        if end.ends_with(['.', '?', '!']) {
            sentences.push(current.join(" "));
            current.clear();
        }
    }
    if !current.is_empty() {
        sentences.push(current.join(" "));
    }
    let mut out: Vec<(String, usize)> = Vec::new();
    for s in sentences {
        let t = count(&s);
        if t <= max_tokens {
            out.push((s, t));
            continue;
        }
        let words: Vec<&str> = s.split(' ').collect();
        let per_piece = (words.len() * max_tokens / t).max(1);
        for chunk in words.chunks(per_piece) {
            let text = chunk.join(" ");
            let t = count(&text);
            out.push((text, t));
        }
    }
    // Regroup consecutive sentences up to the limit, so that a long paragraph does not become many tiny pieces.
    let mut grouped: Vec<(String, usize)> = Vec::new();
    for (s, t) in out {
        match grouped.last_mut() {
            // Joining two sentences with a space costs no extra token with byte-level BPE, where the space rides
            // on the next word.
            Some((g, gt)) if *gt + t <= max_tokens => {
                g.push(' ');
                g.push_str(&s);
                *gt += t;
            }
            _ => grouped.push((s, t)),
        }
    }
    grouped
}

/// Greedily packs paragraphs into documents: a document closes as soon as it reaches `min_tokens`; since no piece
/// exceeds `min_tokens`, none exceeds `2 * min_tokens` (up to the separators' estimate).
fn split_documents(
    stem: &str,
    paragraphs: &[String],
    min_tokens: usize,
    sep_tokens: usize,
    count: &dyn Fn(&str) -> usize,
) -> Vec<Document> {
    let mut docs: Vec<(String, usize)> = Vec::new();
    let mut current = String::new();
    let mut current_tokens = 0usize;
    for para in paragraphs {
        let t = count(para);
        for (piece, pt) in pieces(para, t, min_tokens, count) {
            if !current.is_empty() {
                current.push_str(PARAGRAPH_SEP);
                current_tokens += sep_tokens;
            }
            current.push_str(&piece);
            current_tokens += pt;
            if current_tokens >= min_tokens {
                docs.push((std::mem::take(&mut current), current_tokens));
                current_tokens = 0;
            }
        }
    }
    if !current.is_empty()
        && let Some((last, last_tokens)) = docs.last_mut()
        && *last_tokens + sep_tokens + current_tokens <= 2 * min_tokens
    {
        last.push_str(PARAGRAPH_SEP);
        last.push_str(&current);
        *last_tokens += sep_tokens + current_tokens;
    }
    docs.into_iter().enumerate().map(|(i, (text, _))| Document { name: format!("{stem}:{i:04}"), text }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory under the system temp dir, removed on drop; unique per test and process.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            let dir = std::env::temp_dir().join(format!("pagoda-eval-prose-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create temp dir");
            TempDir(dir)
        }

        fn write(&self, name: &str, bytes: impl AsRef<[u8]>) {
            std::fs::write(self.0.join(name), bytes).expect("write test file");
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Words as tokens: easy to reason about in hand-written text.
    fn words(s: &str) -> usize {
        s.split_whitespace().count()
    }

    /// A hard-wrapped paragraph of `n` words (`w0 w1 ...` with a full stop every 6 words), CRLF line ends.
    fn paragraph(tag: &str, n: usize) -> String {
        let mut out = String::from("  ");
        for i in 0..n {
            out.push_str(&format!("{tag}{i}"));
            out.push_str(if i % 6 == 5 { ".  " } else { " " });
            if i % 9 == 8 {
                out.push_str("\r\n");
            }
        }
        out.trim_end().to_string() + "\r\n"
    }

    #[test]
    fn splits_at_paragraphs_into_the_token_range_in_file_order() {
        let dir = TempDir::new("range");
        let b: Vec<String> = (0..12).map(|i| paragraph(&format!("b{i}x"), 7 + i % 5)).collect();
        let a: Vec<String> = (0..9).map(|i| paragraph(&format!("a{i}x"), 5 + 3 * (i % 4))).collect();
        dir.write("b.txt", b.join("\r\n"));
        dir.write("a.txt", format!("\n\n   ***   ***\n\n{}", a.join("\n  \n")));
        dir.write("notes.md", paragraph("skip", 200));
        std::fs::create_dir(dir.0.join("sub.txt")).expect("a directory named like a text file");

        let docs = load_documents(&dir.0, 20, &words).expect("load");
        assert!(docs.iter().all(|d| (20..=40).contains(&words(&d.text))), "{docs:#?}");
        let names: Vec<&str> = docs.iter().map(|d| d.name.as_str()).collect();
        let first_b = names.iter().position(|n| n.starts_with("b:")).expect("b documents");
        assert!(names[..first_b].iter().all(|n| n.starts_with("a:")) && first_b > 0, "{names:?}");
        assert_eq!(names[0], "a:0000");
        assert_eq!(names[first_b], "b:0000");
        for d in &docs {
            assert!(!d.text.contains('\r') && !d.text.contains("  ") && !d.text.contains('*'), "{:?}", d.text);
            assert!(!d.text.starts_with('\n') && !d.text.ends_with('\n'));
            // Whole paragraphs only: every paragraph of a document starts with its first word.
            for p in d.text.split("\n\n") {
                assert!(p.split(' ').next().is_some_and(|w| w.ends_with("x0")), "cut paragraph {p:?}");
            }
            // Never mixes files.
            let tag = &d.name[..1];
            assert!(d.text.split_whitespace().all(|w| w.starts_with(tag)));
        }
        // Paragraphs come in order and none is lost except a dropped tail.
        let a_text: Vec<&str> =
            docs.iter().filter(|d| d.name.starts_with("a:")).flat_map(|d| d.text.split("\n\n")).collect();
        assert!(a_text.len() >= 7, "{a_text:?}");
        for (i, p) in a_text.iter().enumerate() {
            assert!(p.starts_with(&format!("a{i}x0")), "{i}: {p}");
        }
        assert_eq!(load_documents(&dir.0, 20, &words).expect("reload"), docs);
    }

    #[test]
    fn long_paragraphs_are_cut_at_sentences_and_long_sentences_at_spaces() {
        let dir = TempDir::new("long");
        let sentences = paragraph("s", 150);
        let run_on: String = (0..90).map(|i| format!("r{i}")).collect::<Vec<_>>().join(" ");
        dir.write("long.txt", format!("{sentences}\n{run_on}\n"));
        let docs = load_documents(&dir.0, 25, &words).expect("load");
        assert!(docs.len() >= 5, "{docs:#?}");
        assert!(docs.iter().all(|d| (25..=50).contains(&words(&d.text))), "{docs:#?}");
        let text: Vec<&str> = docs.iter().flat_map(|d| d.text.split_whitespace()).collect();
        // Sentence cuts: every sentence piece from the first paragraph ends with a full stop.
        for d in &docs {
            for p in d.text.split("\n\n").filter(|p| p.starts_with('s')) {
                assert!(p.ends_with('.') || p.ends_with("s149"), "{p:?}");
            }
        }
        assert_eq!(text.first(), Some(&"s0"));
    }

    #[test]
    fn a_short_tail_joins_the_last_document() {
        let dir = TempDir::new("tail");
        dir.write("t.txt", format!("{}\n{}\n{}", paragraph("p", 12), paragraph("q", 12), paragraph("z", 3)));
        let docs = load_documents(&dir.0, 20, &words).expect("load");
        assert_eq!(docs.len(), 1);
        assert_eq!(words(&docs[0].text), 27);
        assert!(docs[0].text.ends_with("z2"));
    }

    #[test]
    fn errors_are_reported_not_panicked() {
        let dir = TempDir::new("errors");
        assert!(matches!(load_documents(&dir.0, 0, &words), Err(EvalError::InvalidArgument(_))));
        assert!(matches!(load_documents(&dir.0, MAX_MIN_TOKENS + 1, &words), Err(EvalError::InvalidArgument(_))));
        assert!(matches!(load_documents(&dir.0, 10, &words), Err(EvalError::NoDocuments { .. })));
        assert!(matches!(load_documents(&dir.0.join("missing"), 10, &words), Err(EvalError::Io { .. })));

        dir.write("short.txt", "Too short to make a document.");
        let err = load_documents(&dir.0, 10, &words).expect_err("no document");
        assert!(err.to_string().contains("fetch-prose.sh"), "{err}");

        dir.write("bad.txt", b"caf\xe9 au lait\n");
        assert!(matches!(load_documents(&dir.0, 10, &words), Err(EvalError::NotUtf8 { .. })));
        std::fs::remove_file(dir.0.join("bad.txt")).expect("remove");

        dir.write("big.txt", "word ".repeat(100));
        let small = Limits { file_bytes: 499, total_bytes: 10_000, files: 10 };
        assert!(matches!(load_with(&dir.0, 10, &words, small), Err(EvalError::FileTooLarge { limit: 499, .. })));
        let total = Limits { file_bytes: 1000, total_bytes: 510, files: 10 };
        assert!(matches!(load_with(&dir.0, 10, &words, total), Err(EvalError::TooMuchText { .. })));
        let files = Limits { file_bytes: 1000, total_bytes: 10_000, files: 1 };
        assert!(matches!(load_with(&dir.0, 10, &words, files), Err(EvalError::TooMuchText { .. })));
        let fits = Limits { file_bytes: 500, total_bytes: 10_000, files: 2 };
        assert_eq!(load_with(&dir.0, 10, &words, fits).expect("within limits").len(), 10);
    }
}
