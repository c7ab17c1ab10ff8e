//! Characters a display hides: what no name a person reads may hold.
//!
//! A job's name, its team and a pipeline's names are printed to other people (`nightshift
//! jobs`, the web UI), who tell one job from another by them. A zero-width space makes
//! `bobjob\u{200b}` print exactly as `bobjob`, and a bidi override (U+202E) reorders what
//! follows it. So these names refuse, and the CLI escapes in anything it prints, every
//! character that draws nothing or changes how its neighbours are drawn:
//!
//! - control characters (Unicode's general category Cc: C0, DEL, C1);
//! - format characters (Cf: zero-width spaces and joiners, bidi marks, embeddings, overrides
//!   and isolates, the byte order mark, tags, ...);
//! - the line and paragraph separators (Zl, Zp);
//! - the rest of Unicode's Default_Ignorable_Code_Point (fillers, variation selectors, the
//!   combining grapheme joiner), which a renderer draws as nothing.
//!
//! The tables are those of Unicode 16.0 (DerivedGeneralCategory.txt and
//! DerivedCoreProperties.txt); a code point unassigned there and assigned later may pass.

/// Ranges of hidden code points, sorted, with what to call those without a name of their own.
const HIDDEN: &[(u32, u32, &str)] = &[
    (0x0000, 0x001F, "a control character"),
    (0x007F, 0x009F, "a control character"),
    (0x00AD, 0x00AD, "soft hyphen"),
    (0x034F, 0x034F, "combining grapheme joiner"),
    (0x0600, 0x0605, "a format character"),
    (0x061C, 0x061C, "arabic letter mark"),
    (0x06DD, 0x06DD, "a format character"),
    (0x070F, 0x070F, "a format character"),
    (0x0890, 0x0891, "a format character"),
    (0x08E2, 0x08E2, "a format character"),
    (0x115F, 0x1160, "a hangul filler"),
    (0x17B4, 0x17B5, "an invisible khmer vowel"),
    (0x180B, 0x180F, "a mongolian free variation selector"),
    (0x200B, 0x200F, "a format character"),
    (0x2028, 0x2029, "a line or paragraph separator"),
    (0x202A, 0x202E, "a bidi control"),
    (0x2060, 0x206F, "a format character"),
    (0x3164, 0x3164, "hangul filler"),
    (0xFE00, 0xFE0F, "a variation selector"),
    (0xFEFF, 0xFEFF, "zero width no-break space"),
    (0xFFA0, 0xFFA0, "halfwidth hangul filler"),
    (0xFFF0, 0xFFFB, "a format character"),
    (0x110BD, 0x110BD, "a format character"),
    (0x110CD, 0x110CD, "a format character"),
    (0x13430, 0x1343F, "a format character"),
    (0x1BCA0, 0x1BCA3, "a format character"),
    (0x1D173, 0x1D17A, "a format character"),
    (0xE0000, 0xE0FFF, "a tag or variation selector"),
];

/// The names of the hidden characters most likely met, for messages.
const NAMES: &[(u32, &str)] = &[
    (0x0000, "null"),
    (0x0009, "tab"),
    (0x000A, "line feed"),
    (0x000D, "carriage return"),
    (0x001B, "escape"),
    (0x007F, "delete"),
    (0x180E, "mongolian vowel separator"),
    (0x200B, "zero width space"),
    (0x200C, "zero width non-joiner"),
    (0x200D, "zero width joiner"),
    (0x200E, "left-to-right mark"),
    (0x200F, "right-to-left mark"),
    (0x2028, "line separator"),
    (0x2029, "paragraph separator"),
    (0x202A, "left-to-right embedding"),
    (0x202B, "right-to-left embedding"),
    (0x202C, "pop directional formatting"),
    (0x202D, "left-to-right override"),
    (0x202E, "right-to-left override"),
    (0x2060, "word joiner"),
    (0x2061, "function application"),
    (0x2062, "invisible times"),
    (0x2063, "invisible separator"),
    (0x2064, "invisible plus"),
    (0x2066, "left-to-right isolate"),
    (0x2067, "right-to-left isolate"),
    (0x2068, "first strong isolate"),
    (0x2069, "pop directional isolate"),
];

/// Whether a display hides `c` or lets it change how its neighbours are drawn.
pub fn is_hidden(c: char) -> bool {
    class(c).is_some()
}

/// The first hidden character of `text`.
pub fn find(text: &str) -> Option<char> {
    text.chars().find(|c| is_hidden(*c))
}

/// `U+200B (zero width space)`: the code point and what it is.
pub fn describe(c: char) -> String {
    let code = c as u32;
    let name = NAMES
        .iter()
        .find(|(n, _)| *n == code)
        .map(|(_, name)| *name)
        .or_else(|| class(c))
        .unwrap_or("a visible character");
    format!("U+{code:04X} ({name})")
}

/// The rule a name with a hidden character breaks: `U+200B (zero width space) is not
/// allowed`, for the caller to prefix with the field.
pub fn check(text: &str) -> Result<(), String> {
    match find(text) {
        Some(c) => Err(format!("{} is not allowed", describe(c))),
        None => Ok(()),
    }
}

fn class(c: char) -> Option<&'static str> {
    let code = c as u32;
    let i = HIDDEN.partition_point(|(_, last, _)| *last < code);
    HIDDEN
        .get(i)
        .filter(|(first, _, _)| *first <= code)
        .map(|(_, _, class)| *class)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_sorted_and_disjoint() {
        for pair in HIDDEN.windows(2) {
            assert!(pair[0].0 <= pair[0].1 && pair[0].1 < pair[1].0, "{pair:?}");
        }
    }

    #[test]
    fn invisible_and_reordering_characters_are_hidden() {
        for c in [
            '\0',
            '\t',
            '\n',
            '\u{1b}',
            '\u{7f}',
            '\u{85}',
            '\u{ad}',
            '\u{34f}',
            '\u{61c}',
            '\u{180e}',
            '\u{200b}',
            '\u{200d}',
            '\u{200f}',
            '\u{2028}',
            '\u{202e}',
            '\u{2060}',
            '\u{2066}',
            '\u{2069}',
            '\u{3164}',
            '\u{fe0f}',
            '\u{feff}',
            '\u{fff9}',
            '\u{e0001}',
            '\u{e0041}',
            '\u{e0100}',
        ] {
            assert!(is_hidden(c), "{}", describe(c));
        }
        for c in [
            'a',
            'Z',
            '0',
            ' ',
            '-',
            '_',
            '.',
            'é',
            'ß',
            'ж',
            '日',
            'ا',
            '\u{300}',
            '\u{a0}',
            '\u{2010}',
            '\u{fffd}',
            '🚀',
            '\u{10ffff}',
        ] {
            assert!(!is_hidden(c), "{}", describe(c));
        }
    }

    #[test]
    fn a_message_names_the_code_point_and_the_character() {
        assert_eq!(
            check("bobjob\u{200b}"),
            Err("U+200B (zero width space) is not allowed".to_owned())
        );
        assert_eq!(
            check("x\u{202e}gnp.exe"),
            Err("U+202E (right-to-left override) is not allowed".to_owned())
        );
        assert_eq!(describe('\u{2066}'), "U+2066 (left-to-right isolate)");
        assert_eq!(describe('\u{1}'), "U+0001 (a control character)");
        assert_eq!(
            describe('\u{e0067}'),
            "U+E0067 (a tag or variation selector)"
        );
        assert_eq!(check("train-llama 7B, é"), Ok(()));
        assert_eq!(find("a\u{2066}b\u{200b}"), Some('\u{2066}'));
    }
}
