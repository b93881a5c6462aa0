//! Megatron's `--moe-layer-freq`: which layers are mixture-of-experts layers; and its
//! `--window-attn-skip-freq`, which attend through the sliding window (`window_layers`).
//!
//! Two spellings, as Megatron takes them: an integer N (layer i is an MoE layer when i % N == 0:
//! one in N), or a Python list expression of 0s and 1s built with `+` (concatenation), `*`
//! (repetition) and brackets, e.g. `([0]+[1]*23)` or `([1]*3+[0]*1)*3`. Megatron evaluates the
//! latter with Python's `eval`; this reads exactly that grammar and nothing else.

use anyhow::{Context, bail};

/// Per layer: true where it is an MoE layer.
pub fn parse(spec: &str, num_layers: usize) -> anyhow::Result<Vec<bool>> {
    let text = spec.trim();
    match text.parse::<usize>() {
        Ok(0) => bail!("--moe-layer-freq 0: give N ≥ 1 (one MoE layer in N) or a list such as \"[1,0]*4\""),
        Ok(n) => Ok((0..num_layers).map(|i| i % n == 0).collect()),
        Err(_) => list("--moe-layer-freq", text, num_layers),
    }
}

/// Megatron's `--window-attn-skip-freq`, the same two spellings: per layer, true where the
/// sliding window applies. An integer N makes every Nth layer counting from 1 a full-attention
/// one (Megatron's `layer_number % N != 0` windowed); a list gives 1 (windowed) or 0 a layer.
pub fn window_layers(spec: &str, num_layers: usize) -> anyhow::Result<Vec<bool>> {
    let text = spec.trim();
    match text.parse::<usize>() {
        Ok(0) => bail!(
            "--window-attn-skip-freq 0: give N ≥ 1 (one full-attention layer in N) or a list such as \"[1,1,1,0]*2\""
        ),
        Ok(n) => Ok((1..=num_layers).map(|l| l % n != 0).collect()),
        Err(_) => list("--window-attn-skip-freq", text, num_layers),
    }
}

/// A list expression of `flag`'s, one entry a layer.
fn list(flag: &str, text: &str, num_layers: usize) -> anyhow::Result<Vec<bool>> {
    let mut p = Parser { s: text.as_bytes(), at: 0 };
    let v = p.expr().with_context(|| format!("{flag} {text}: not a list expression Megatron takes"))?;
    p.space();
    if p.at != p.s.len() {
        bail!("{flag} {text}: unexpected text at character {}", p.at + 1);
    }
    if v.len() != num_layers {
        bail!("{flag} {text} gives {} layers but --num-layers is {num_layers}: one entry per layer", v.len());
    }
    Ok(v)
}

/// The list form of `pattern`, which `parse` reads back.
pub fn render(pattern: &[bool]) -> String {
    let items: Vec<&str> = pattern.iter().map(|&m| if m { "1" } else { "0" }).collect();
    format!("[{}]", items.join(","))
}

struct Parser<'a> {
    s: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn space(&mut self) {
        while self.s.get(self.at).is_some_and(|c| c.is_ascii_whitespace()) {
            self.at += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        self.space();
        if self.s.get(self.at) == Some(&c) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn int(&mut self) -> anyhow::Result<usize> {
        self.space();
        let start = self.at;
        while self.s.get(self.at).is_some_and(u8::is_ascii_digit) {
            self.at += 1;
        }
        std::str::from_utf8(&self.s[start..self.at])?
            .parse()
            .with_context(|| format!("a number at character {}", start + 1))
    }

    /// term ('+' term)*
    fn expr(&mut self) -> anyhow::Result<Vec<bool>> {
        let mut v = self.term()?;
        while self.eat(b'+') {
            v.extend(self.term()?);
        }
        Ok(v)
    }

    /// atom ('*' int)*
    fn term(&mut self) -> anyhow::Result<Vec<bool>> {
        let mut v = self.atom()?;
        while self.eat(b'*') {
            let n = self.int()?;
            v = v.repeat(n);
        }
        Ok(v)
    }

    /// '[' 0|1 (',' 0|1)* ']' | '(' expr ')'
    fn atom(&mut self) -> anyhow::Result<Vec<bool>> {
        if self.eat(b'(') {
            let v = self.expr()?;
            if !self.eat(b')') {
                bail!("a ')' at character {}", self.at + 1);
            }
            return Ok(v);
        }
        if !self.eat(b'[') {
            bail!("a '[' or '(' at character {}", self.at + 1);
        }
        let mut v = vec![];
        if self.eat(b']') {
            return Ok(v);
        }
        loop {
            match self.int()? {
                0 => v.push(false),
                1 => v.push(true),
                n => bail!("{n} in the list: each layer's entry is 0 or 1"),
            }
            if self.eat(b']') {
                return Ok(v);
            }
            if !self.eat(b',') {
                bail!("a ',' or ']' at character {}", self.at + 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatrons_spellings() {
        let b = |s: &str| s.chars().map(|c| c == '1').collect::<Vec<_>>();
        assert_eq!(parse("1", 3).unwrap(), b("111"));
        assert_eq!(parse("2", 5).unwrap(), b("10101"));
        assert_eq!(parse("([0]+[1]*3)", 4).unwrap(), b("0111"));
        assert_eq!(parse("([1]*3+[0]*1)*3", 12).unwrap(), b("111011101110"));
        assert_eq!(parse(" [1, 0] * 2 ", 4).unwrap(), b("1010"));
        let p = b("0110");
        assert_eq!(parse(&render(&p), 4).unwrap(), p);
    }

    #[test]
    fn bad_patterns_are_named() {
        let e = |s: &str, n| format!("{:#}", parse(s, n).unwrap_err());
        assert!(e("[1,0]*2", 3).contains("gives 4 layers but --num-layers is 3"));
        assert!(e("[1,2]", 2).contains("entry is 0 or 1"));
        assert!(e("[1,0", 2).contains("not a list expression"));
        assert!(e("0", 2).contains("N ≥ 1"));
        assert!(e("[1]*2 junk", 2).contains("unexpected text"));
        assert!(e("import os", 2).contains("not a list expression"));
    }

    #[test]
    fn window_layers_count_full_attention_layers_from_one() {
        let b = |s: &str| s.chars().map(|c| c == '1').collect::<Vec<_>>();
        // Megatron's is_layer_window_attention: layer_number (from 1) % N != 0 is windowed.
        assert_eq!(window_layers("2", 5).unwrap(), b("10101"));
        assert_eq!(window_layers("4", 8).unwrap(), b("11101110"));
        assert_eq!(window_layers("1", 3).unwrap(), b("000"));
        assert_eq!(window_layers("[1,1,0]*2", 6).unwrap(), b("110110"));
        let e = |s: &str, n| format!("{:#}", window_layers(s, n).unwrap_err());
        assert!(e("0", 2).contains("--window-attn-skip-freq 0") && e("0", 2).contains("N ≥ 1"));
        assert!(e("[1,0]", 3).contains("--window-attn-skip-freq [1,0] gives 2 layers"));
    }
}
