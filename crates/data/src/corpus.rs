//! The built-in training corpus: short templated stories and arithmetic facts, generated from a
//! seed. It has structure a small model can learn in minutes (recurring names, consistent pronouns,
//! sums that are right), so a falling validation loss means the model is learning, not memorising.

use ferrotron_core::rng::Philox;

const NAMES: &[(&str, &str)] = &[
    ("Mia", "she"),
    ("Leo", "he"),
    ("Ana", "she"),
    ("Tom", "he"),
    ("Ivy", "she"),
    ("Sam", "he"),
    ("Zoe", "she"),
    ("Max", "he"),
    ("Eva", "she"),
    ("Ben", "he"),
    ("Lily", "she"),
    ("Owen", "he"),
];
const ANIMALS: &[&str] = &["cat", "dog", "fox", "owl", "rabbit", "bear", "duck", "mouse"];
const PLACES: &[&str] = &["a small house", "the forest", "a big city", "the old farm", "a quiet village", "the hills"];
const HABITS: &[&str] =
    &["read a book", "went for a walk", "baked bread", "sang a song", "played in the garden", "fed the birds"];
const OBJECTS: &[&str] = &["red ball", "shiny key", "blue box", "tiny boat", "golden coin", "paper kite"];
const FEELINGS: &[&str] = &["happy", "surprised", "curious", "excited", "proud"];

struct Draw {
    rng: Philox,
    i: u64,
}

impl Draw {
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        self.i += 1;
        &xs[self.rng.u32_at(self.i) as usize % xs.len()]
    }
    fn below(&mut self, n: u32) -> u32 {
        self.i += 1;
        self.rng.u32_at(self.i) % n
    }
}

fn story(d: &mut Draw) -> String {
    let (name, he) = *d.pick(NAMES);
    let (animal, place, habit, object, feeling) =
        (d.pick(ANIMALS), d.pick(PLACES), d.pick(HABITS), d.pick(OBJECTS), d.pick(FEELINGS));
    let cap = |s: &str| s[..1].to_uppercase() + &s[1..];
    format!(
        "Once upon a time, {name} the {animal} lived in {place}. Every day, {name} {habit}. \
         One morning, {he} found a {object}. {} was very {feeling}. \"What a nice {object}!\" said {name}. \
         From that day on, {name} kept the {object} close.",
        cap(he)
    )
}

fn arithmetic(d: &mut Draw) -> String {
    (0..4)
        .map(|_| {
            let (a, b) = (d.below(50), d.below(50));
            if d.below(2) == 0 { format!("{a} + {b} = {}.", a + b) } else { format!("{} - {b} = {a}.", a + b) }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `n` documents from `seed`; two in three are stories, the rest arithmetic facts.
pub fn documents(seed: u64, n: usize) -> Vec<String> {
    let mut d = Draw { rng: Philox::new(seed).with_stream(0x636f_7270), i: 0 };
    (0..n).map(|_| if d.below(3) < 2 { story(&mut d) } else { arithmetic(&mut d) }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_correct_sums() {
        let a = documents(5, 200);
        assert_eq!(a, documents(5, 200));
        assert_ne!(a, documents(6, 200));
        let facts: Vec<&String> = a.iter().filter(|s| s.contains(" = ")).collect();
        assert!(facts.len() > 20 && a.iter().any(|s| s.starts_with("Once upon a time")));
        for doc in facts {
            for fact in doc.split(". ") {
                let f = fact.trim_end_matches('.');
                let (lhs, rhs) = f.split_once(" = ").unwrap();
                let parts: Vec<&str> = lhs.split(' ').collect();
                let (x, op, y): (i64, &str, i64) = (parts[0].parse().unwrap(), parts[1], parts[2].parse().unwrap());
                let want = if op == "+" { x + y } else { x - y };
                assert_eq!(want, rhs.parse::<i64>().unwrap(), "{f}");
            }
        }
    }
}
