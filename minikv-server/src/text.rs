//! Stop strings on generated text (text that may begin a stop string is held
//! back until it is known not to); the text itself comes from
//! [`minikv_models::Detokenizer`].

/// Cuts generated text at the first stop string (the stop string itself is
/// not returned, as in the OpenAI API).
#[derive(Debug, Default)]
pub struct StopText {
    stops: Vec<String>,
    held: String,
}

/// What [`StopText::push`] releases.
#[derive(Debug, PartialEq)]
pub struct Released {
    /// Text safe to send.
    pub text: String,
    /// A stop string was found (the text before it is in `text`).
    pub stopped: bool,
}

impl StopText {
    /// A matcher for `stops` (non-empty strings).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            held: String::new(),
        }
    }

    /// Adds text; releases what can no longer begin a stop string.
    pub fn push(&mut self, delta: &str) -> Released {
        self.held.push_str(delta);
        if let Some(p) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let text = self.held[..p].to_owned();
            self.held.clear();
            return Released {
                text,
                stopped: true,
            };
        }
        // Hold the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if k > keep && self.held.ends_with(&s[..k]) {
                    keep = k;
                }
            }
        }
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_owned();
        self.held.drain(..cut);
        Released {
            text,
            stopped: false,
        }
    }

    /// What is held, at the end of the sequence.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = s.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&s.flush());
        (out, false)
    }

    #[test]
    fn stop_strings_across_pieces() {
        assert_eq!(run(&["\n\n"], &["a", "b\n", "\nc"]), ("ab".into(), true));
        assert_eq!(run(&["END"], &["xE", "N", "y"]), ("xENy".into(), false));
        assert_eq!(run(&["END"], &["xE", "N", "Dz"]), ("x".into(), true));
        // The earliest of several stops wins.
        assert_eq!(run(&["c", "ab"], &["xabc"]), ("x".into(), true));
        // No stops: everything passes at once.
        let mut s = StopText::new(vec![]);
        assert_eq!(s.push("héllo").text, "héllo");
        // Multi-byte prefixes are held on character boundaries.
        assert_eq!(run(&["éé"], &["aé", "b"]), ("aéb".into(), false));
        assert_eq!(run(&["éé"], &["aé", "é"]), ("a".into(), true));
    }

    #[test]
    fn nothing_is_released_early() {
        let mut s = StopText::new(vec!["###".into()]);
        assert_eq!(s.push("a#").text, "a");
        assert_eq!(s.push("#").text, "");
        let r = s.push("#");
        assert!(r.stopped && r.text.is_empty());
    }
}
