//! Unit tests of the RULER generators' helpers.

use super::niah::niah_question;
use super::*;

#[test]
fn sentences_split_after_terminal_punctuation() {
    let s = sentences("One two.  Three?\nFour five! 3.5 is a number. End");
    assert_eq!(
        s,
        vec!["One two.", "Three?", "Four five!", "3.5 is a number."]
    );
}

#[test]
fn questions_name_every_key() {
    let (q, p) = niah_question("numbers", &["a".into(), "b".into(), "c".into()]);
    assert!(q.contains("for a, b and c mentioned"), "{q}");
    assert!(p.ends_with("for a, b and c mentioned in the provided text are"));
}
