//! Python's pickle (protocols 2–5, the binary opcodes `torch.save` and `pickle.dump` write) read
//! into a plain value tree, running no code: a class or function is kept as its name, a call as
//! the callable and its arguments, `BUILD` as the object's state. What the objects mean
//! (`torch._utils._rebuild_tensor_v2`, `argparse.Namespace`, DCP's dataclasses) is for the
//! readers above to interpret.
//!
//! Objects live in an arena and the stack and memo hold indices, so an object mutated after it
//! was memoized (a dict filled by SETITEMS, an object given its state by BUILD) is the same
//! object wherever it is fetched again, as in Python.

use std::collections::HashMap;

/// A pickled value.
#[derive(Clone, Debug, PartialEq)]
pub enum Py {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Py>),
    Tuple(Vec<Py>),
    Dict(Vec<(Py, Py)>),
    /// `module.name`: a class, function or constant (torch.bfloat16).
    Global(String, String),
    /// A persistent id (`torch.save`'s storages): its tuple.
    Persistent(Box<Py>),
    /// `callable(*args)` (REDUCE, NEWOBJ), then `state` (BUILD), `items` (SETITEMS on the
    /// result, as OrderedDict's) and `elems` (APPENDS).
    Object {
        callable: Box<Py>,
        args: Vec<Py>,
        state: Option<Box<Py>>,
        items: Vec<(Py, Py)>,
        elems: Vec<Py>,
    },
}

impl Py {
    /// `module.class(*args)` (pickled as REDUCE).
    pub fn call(module: &str, class: &str, args: Vec<Py>) -> Py {
        Py::Object {
            callable: Box::new(Py::Global(module.into(), class.into())),
            args,
            state: None,
            items: vec![],
            elems: vec![],
        }
    }

    /// An instance of `module.class` made without calling it and given `state` (pickled as
    /// NEWOBJ then BUILD, as Python pickles a plain class, a dataclass or a Namespace).
    pub fn instance(module: &str, class: &str, state: Py) -> Py {
        Py::Object {
            callable: Box::new(Py::Global(module.into(), class.into())),
            args: vec![],
            state: Some(Box::new(state)),
            items: vec![],
            elems: vec![],
        }
    }

    /// An instance whose state is the dict of attributes `attrs`.
    pub fn with_attrs(module: &str, class: &str, attrs: Vec<(&str, Py)>) -> Py {
        Py::instance(module, class, Py::Dict(attrs.into_iter().map(|(k, v)| (Py::Str(k.into()), v)).collect()))
    }

    /// The entry `key` of a dict, an OrderedDict or an object's state dict (its attributes).
    pub fn get(&self, key: &str) -> Option<&Py> {
        fn find<'a>(items: &'a [(Py, Py)], key: &str) -> Option<&'a Py> {
            items.iter().find(|(k, _)| matches!(k, Py::Str(s) if s == key)).map(|(_, v)| v)
        }
        let find = |items| find(items, key);
        match self {
            Py::Dict(items) => find(items),
            Py::Object { state, items, .. } => {
                find(items).or_else(|| state.as_deref().and_then(|s| s.attrs()?.get(key)))
            }
            _ => None,
        }
    }

    /// An object's attributes: its state dict, or the dict of a `(dict, slots)` state.
    fn attrs(&self) -> Option<&Py> {
        match self {
            Py::Dict(_) => Some(self),
            Py::Tuple(t) if t.len() == 2 => t.iter().find(|p| matches!(p, Py::Dict(d) if !d.is_empty())),
            _ => None,
        }
    }

    /// The (key, value) pairs of a dict, an OrderedDict or a `defaultdict`.
    pub fn items(&self) -> Option<&[(Py, Py)]> {
        match self {
            Py::Dict(items) => Some(items),
            Py::Object { items, .. } => Some(items),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Py::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Py::Int(i) => Some(*i),
            Py::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }

    /// A tuple or list of ints, or a `torch.Size` (a call of torch.Size on one).
    pub fn as_ints(&self) -> Option<Vec<i64>> {
        match self {
            Py::Tuple(v) | Py::List(v) => v.iter().map(Py::as_int).collect(),
            Py::Object { callable, args, .. } if callable.is_global("torch", "Size") => args.first()?.as_ints(),
            _ => None,
        }
    }

    pub fn is_global(&self, module: &str, name: &str) -> bool {
        matches!(self, Py::Global(m, n) if m == module && n == name)
    }

    /// The class (or function) an object was made by: `module.name`.
    pub fn class(&self) -> Option<(&str, &str)> {
        match self {
            Py::Object { callable, .. } => match callable.as_ref() {
                Py::Global(m, n) => Some((m, n)),
                _ => None,
            },
            _ => None,
        }
    }
}

/// One arena slot: a value whose containers refer to other slots.
#[derive(Clone)]
enum Node {
    Leaf(Py),
    List(Vec<usize>),
    Tuple(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    Persistent(usize),
    Object { callable: usize, args: usize, state: Option<usize>, items: Vec<(usize, usize)>, elems: Vec<usize> },
}

/// Why a pickle could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PickleError {
    #[error("the pickle ends early (at byte {0})")]
    Truncated(usize),
    #[error("pickle opcode {op:#04x} at byte {at} is not read here")]
    Opcode { op: u8, at: usize },
    #[error("corrupt pickle at byte {at}: {why}")]
    Corrupt { at: usize, why: String },
}

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    arena: Vec<Node>,
    stack: Vec<usize>,
    marks: Vec<usize>,
    memo: HashMap<u64, usize>,
}

/// Reads one pickle from `data`.
pub fn load(data: &[u8]) -> Result<Py, PickleError> {
    let mut vm = Vm { data, pos: 0, arena: vec![], stack: vec![], marks: vec![], memo: HashMap::new() };
    let root = vm.run()?;
    Ok(vm.value(root, 0))
}

impl Vm<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], PickleError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len()).ok_or(PickleError::Truncated(self.pos))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }
    fn le<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }
    fn len(&mut self, bytes: usize) -> Result<usize, PickleError> {
        let v = match bytes {
            1 => self.u8()? as u64,
            4 => u32::from_le_bytes(self.le()?) as u64,
            _ => u64::from_le_bytes(self.le()?),
        };
        usize::try_from(v).map_err(|_| self.corrupt("a length past the address space"))
    }
    fn line(&mut self) -> Result<String, PickleError> {
        let rest = &self.data[self.pos..];
        let n = rest.iter().position(|&b| b == b'\n').ok_or(PickleError::Truncated(self.data.len()))?;
        let s = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.pos += n + 1;
        Ok(s)
    }
    fn corrupt(&self, why: &str) -> PickleError {
        PickleError::Corrupt { at: self.pos, why: why.into() }
    }
    fn push(&mut self, n: Node) {
        self.arena.push(n);
        self.stack.push(self.arena.len() - 1);
    }
    fn leaf(&mut self, p: Py) {
        self.push(Node::Leaf(p));
    }
    fn pop(&mut self) -> Result<usize, PickleError> {
        self.stack.pop().ok_or_else(|| self.corrupt("pop from an empty stack"))
    }
    fn top(&self) -> Result<usize, PickleError> {
        self.stack.last().copied().ok_or_else(|| self.corrupt("an empty stack"))
    }
    /// The items pushed since the last MARK, removed from the stack.
    fn pop_mark(&mut self) -> Result<Vec<usize>, PickleError> {
        let m = self.marks.pop().ok_or_else(|| self.corrupt("no MARK"))?;
        if m > self.stack.len() {
            return Err(self.corrupt("MARK past the stack"));
        }
        Ok(self.stack.split_off(m))
    }
    fn text(&self, b: &[u8]) -> Result<String, PickleError> {
        String::from_utf8(b.to_vec()).map_err(|_| self.corrupt("a string that is not UTF-8"))
    }
    fn str_at(&self, id: usize) -> Result<String, PickleError> {
        match &self.arena[id] {
            Node::Leaf(Py::Str(s)) => Ok(s.clone()),
            _ => Err(self.corrupt("STACK_GLOBAL without two strings")),
        }
    }
    fn memo_get(&mut self, key: u64) -> Result<(), PickleError> {
        let id = *self.memo.get(&key).ok_or_else(|| self.corrupt(&format!("memo {key} unset")))?;
        self.stack.push(id);
        Ok(())
    }
    fn memo_put(&mut self, key: u64) -> Result<(), PickleError> {
        let id = self.top()?;
        self.memo.insert(key, id);
        Ok(())
    }
    fn add_items(&mut self, target: usize, flat: Vec<usize>) -> Result<(), PickleError> {
        if flat.len() % 2 != 0 {
            return Err(self.corrupt("SETITEMS with an odd count"));
        }
        let pairs = flat.chunks(2).map(|p| (p[0], p[1]));
        match &mut self.arena[target] {
            Node::Dict(items) | Node::Object { items, .. } => items.extend(pairs),
            _ => return Err(self.corrupt("SETITEMS on something not a dict")),
        }
        Ok(())
    }
    fn add_elems(&mut self, target: usize, elems: Vec<usize>) -> Result<(), PickleError> {
        match &mut self.arena[target] {
            Node::List(v) | Node::Object { elems: v, .. } => v.extend(elems),
            _ => return Err(self.corrupt("APPENDS on something not a list")),
        }
        Ok(())
    }
    fn call(&mut self, callable: usize, args: usize) {
        self.push(Node::Object { callable, args, state: None, items: vec![], elems: vec![] });
    }

    fn run(&mut self) -> Result<usize, PickleError> {
        loop {
            let at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    self.u8()?;
                } // PROTO
                0x95 => {
                    self.take(8)?;
                } // FRAME: frames are read through
                b'.' => return self.pop(),                 // STOP
                b'(' => self.marks.push(self.stack.len()), // MARK
                b'0' => {
                    self.pop()?;
                } // POP
                b'1' => {
                    self.pop_mark()?;
                } // POP_MARK
                b'2' => {
                    // DUP
                    let t = self.top()?;
                    self.stack.push(t);
                }
                b'N' => self.leaf(Py::None),
                0x88 => self.leaf(Py::Bool(true)),
                0x89 => self.leaf(Py::Bool(false)),
                b'J' => {
                    let v = i32::from_le_bytes(self.le()?) as i64;
                    self.leaf(Py::Int(v))
                }
                b'K' => {
                    let v = self.u8()? as i64;
                    self.leaf(Py::Int(v))
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.le()?) as i64;
                    self.leaf(Py::Int(v))
                }
                0x8a | 0x8b => {
                    // LONG1, LONG4: little-endian two's complement
                    let n = if op == 0x8a { self.u8()? as usize } else { self.len(4)? };
                    let b = self.take(n)?;
                    if n > 8 {
                        return Err(self.corrupt("an integer wider than 64 bits"));
                    }
                    let mut v: i64 = 0;
                    for (i, &x) in b.iter().enumerate() {
                        v |= (x as i64) << (8 * i);
                    }
                    if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                        v -= 1i64 << (8 * n);
                    }
                    self.leaf(Py::Int(v))
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.le()?);
                    self.leaf(Py::Float(v))
                }
                b'I' => {
                    // INT (protocol 0): "01"/"00" are bools
                    let l = self.line()?;
                    let v = match l.as_str() {
                        "01" => Py::Bool(true),
                        "00" => Py::Bool(false),
                        s => Py::Int(s.parse().map_err(|_| self.corrupt("INT"))?),
                    };
                    self.leaf(v)
                }
                0x8c | b'X' | 0x8d => {
                    // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
                    let n = self.len(match op {
                        0x8c => 1,
                        b'X' => 4,
                        _ => 8,
                    })?;
                    let b = self.take(n)?.to_vec();
                    let s = self.text(&b)?;
                    self.leaf(Py::Str(s))
                }
                b'U' | b'T' => {
                    // SHORT_BINSTRING, BINSTRING (Python 2 str): kept as text
                    let n = self.len(if op == b'U' { 1 } else { 4 })?;
                    let s = String::from_utf8_lossy(self.take(n)?).into_owned();
                    self.leaf(Py::Str(s))
                }
                b'C' | b'B' | 0x8e | 0x96 => {
                    // SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
                    let n = self.len(match op {
                        b'C' => 1,
                        b'B' => 4,
                        _ => 8,
                    })?;
                    let b = self.take(n)?.to_vec();
                    self.leaf(Py::Bytes(b))
                }
                b')' => self.push(Node::Tuple(vec![])),
                b't' => {
                    let v = self.pop_mark()?;
                    self.push(Node::Tuple(v))
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n {
                        return Err(self.corrupt("TUPLEn past the stack"));
                    }
                    let v = self.stack.split_off(self.stack.len() - n);
                    self.push(Node::Tuple(v))
                }
                b']' => self.push(Node::List(vec![])),
                b'l' => {
                    let v = self.pop_mark()?;
                    self.push(Node::List(v))
                }
                b'a' => {
                    let v = self.pop()?;
                    let t = self.top()?;
                    self.add_elems(t, vec![v])?
                }
                b'e' => {
                    let v = self.pop_mark()?;
                    let t = self.top()?;
                    self.add_elems(t, v)?
                }
                b'}' => self.push(Node::Dict(vec![])),
                b'd' => {
                    let v = self.pop_mark()?;
                    self.push(Node::Dict(vec![]));
                    let t = self.top()?;
                    self.add_items(t, v)?
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let t = self.top()?;
                    self.add_items(t, vec![k, v])?
                }
                b'u' => {
                    let v = self.pop_mark()?;
                    let t = self.top()?;
                    self.add_items(t, v)?
                }
                0x8f => self.push(Node::List(vec![])), // EMPTY_SET: a list here
                0x90 => {
                    // ADDITEMS
                    let v = self.pop_mark()?;
                    let t = self.top()?;
                    self.add_elems(t, v)?
                }
                0x91 => {
                    // FROZENSET
                    let v = self.pop_mark()?;
                    self.push(Node::List(v))
                }
                b'c' => {
                    // GLOBAL "module\nname\n"
                    let (m, n) = (self.line()?, self.line()?);
                    self.leaf(Py::Global(m, n))
                }
                0x93 => {
                    // STACK_GLOBAL
                    let n = self.pop()?;
                    let m = self.pop()?;
                    let (m, n) = (self.str_at(m)?, self.str_at(n)?);
                    self.leaf(Py::Global(m, n))
                }
                b'R' | 0x81 => {
                    // REDUCE, NEWOBJ: callable(*args) / cls.__new__(cls, *args)
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.call(callable, args)
                }
                0x92 => {
                    // NEWOBJ_EX: cls, args, kwargs (kwargs dropped)
                    self.pop()?;
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.call(callable, args)
                }
                b'b' => {
                    // BUILD
                    let state = self.pop()?;
                    let t = self.top()?;
                    match &mut self.arena[t] {
                        Node::Object { state: s, .. } => *s = Some(state),
                        _ => return Err(self.corrupt("BUILD on something not an object")),
                    }
                }
                b'Q' => {
                    // BINPERSID
                    let pid = self.pop()?;
                    self.push(Node::Persistent(pid))
                }
                b'h' => {
                    let k = self.u8()? as u64;
                    self.memo_get(k)?
                }
                b'j' => {
                    let k = u32::from_le_bytes(self.le()?) as u64;
                    self.memo_get(k)?
                }
                b'g' => {
                    let k = self.line()?.parse().map_err(|_| self.corrupt("GET"))?;
                    self.memo_get(k)?
                }
                b'q' => {
                    let k = self.u8()? as u64;
                    self.memo_put(k)?
                }
                b'r' => {
                    let k = u32::from_le_bytes(self.le()?) as u64;
                    self.memo_put(k)?
                }
                b'p' => {
                    let k = self.line()?.parse().map_err(|_| self.corrupt("PUT"))?;
                    self.memo_put(k)?
                }
                0x94 => {
                    // MEMOIZE
                    let k = self.memo.len() as u64;
                    self.memo_put(k)?
                }
                _ => return Err(PickleError::Opcode { op, at }),
            }
        }
    }

    /// The value tree of slot `id` (a cycle, which state dicts do not have, is cut at depth 200).
    fn value(&self, id: usize, depth: usize) -> Py {
        if depth > 200 {
            return Py::None;
        }
        let v = |i: &usize| self.value(*i, depth + 1);
        let pairs = |items: &[(usize, usize)]| items.iter().map(|(k, x)| (v(k), v(x))).collect();
        match &self.arena[id] {
            Node::Leaf(p) => p.clone(),
            Node::List(x) => Py::List(x.iter().map(v).collect()),
            Node::Tuple(x) => Py::Tuple(x.iter().map(v).collect()),
            Node::Dict(items) => Py::Dict(pairs(items)),
            Node::Persistent(p) => Py::Persistent(Box::new(v(p))),
            Node::Object { callable, args, state, items, elems } => Py::Object {
                callable: Box::new(v(callable)),
                args: match v(args) {
                    Py::Tuple(a) | Py::List(a) => a,
                    other => vec![other],
                },
                state: state.as_ref().map(|s| Box::new(v(s))),
                items: pairs(items),
                elems: elems.iter().map(v).collect(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pickle.dumps({'a': [1, -2, 300, 70000, 2**40, -2**40, 1.5, None, True], 'b': ('x',
    /// b'yz')}, protocol=2)` (Python 3.11).
    const P2: &[u8] = b"\x80\x02\x7d\x71\x00\x28\x58\x01\x00\x00\x00\x61\x71\x01\x5d\x71\x02\x28\x4b\x01\x4a\xfe\xff\xff\xff\x4d\x2c\x01\x4a\x70\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\x01\x8a\x06\x00\x00\x00\x00\x00\xff\x47\x3f\xf8\x00\x00\x00\x00\x00\x00\x4e\x88\x65\x58\x01\x00\x00\x00\x62\x71\x03\x58\x01\x00\x00\x00\x78\x71\x04\x63\x5f\x63\x6f\x64\x65\x63\x73\x0a\x65\x6e\x63\x6f\x64\x65\x0a\x71\x05\x58\x02\x00\x00\x00\x79\x7a\x71\x06\x58\x06\x00\x00\x00\x6c\x61\x74\x69\x6e\x31\x71\x07\x86\x71\x08\x52\x71\x09\x86\x71\x0a\x75\x2e";
    /// `d = {'a': 1}; pickle.dumps(argparse.Namespace(hidden_size=64, eps=1e-5, pair=[d, d],
    /// name='Llama'), protocol=4)`: the dict is memoized empty, filled, then fetched again.
    const P4: &[u8] = b"\x80\x04\x95\x66\x00\x00\x00\x00\x00\x00\x00\x8c\x08\x61\x72\x67\x70\x61\x72\x73\x65\x94\x8c\x09\x4e\x61\x6d\x65\x73\x70\x61\x63\x65\x94\x93\x94\x29\x81\x94\x7d\x94\x28\x8c\x0b\x68\x69\x64\x64\x65\x6e\x5f\x73\x69\x7a\x65\x94\x4b\x40\x8c\x03\x65\x70\x73\x94\x47\x3e\xe4\xf8\xb5\x88\xe3\x68\xf1\x8c\x04\x70\x61\x69\x72\x94\x5d\x94\x28\x7d\x94\x8c\x01\x61\x94\x4b\x01\x73\x68\x09\x65\x8c\x04\x6e\x61\x6d\x65\x94\x8c\x05\x4c\x6c\x61\x6d\x61\x94\x75\x62\x2e";
    /// `pickle.dumps({'big': 2**62, 's': frozenset([3]), 'by': bytearray(b'q')}, protocol=5)`.
    const P5: &[u8] = b"\x80\x05\x95\x2e\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x03\x62\x69\x67\x94\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x40\x8c\x01\x73\x94\x28\x4b\x03\x91\x94\x8c\x02\x62\x79\x94\x96\x01\x00\x00\x00\x00\x00\x00\x00\x71\x94\x75\x2e";

    #[test]
    fn reads_what_python_writes() {
        let v = load(P2).unwrap();
        let ints = [1, -2, 300, 70000, 1 << 40, -(1 << 40)].map(Py::Int);
        let mut want = ints.to_vec();
        want.extend([Py::Float(1.5), Py::None, Py::Bool(true)]);
        assert_eq!(v.get("a"), Some(&Py::List(want)));
        let Some(Py::Tuple(b)) = v.get("b") else { panic!("{v:?}") };
        assert_eq!(b[0], Py::Str("x".into()));
        // Python 2-compatible bytes: a call of _codecs.encode, kept as the call
        assert_eq!(b[1].class(), Some(("_codecs", "encode")));

        let ns = load(P4).unwrap();
        assert_eq!(ns.class(), Some(("argparse", "Namespace")));
        assert_eq!(ns.get("hidden_size"), Some(&Py::Int(64)));
        assert_eq!(ns.get("eps"), Some(&Py::Float(1e-5)));
        assert_eq!(ns.get("name").and_then(Py::as_str), Some("Llama"));
        let Some(Py::List(pair)) = ns.get("pair") else { panic!("{ns:?}") };
        // The second is the memo's: the same dict, filled after it was memoized.
        assert_eq!(pair[1], pair[0]);
        assert_eq!(pair[1].get("a"), Some(&Py::Int(1)));

        let v = load(P5).unwrap();
        assert_eq!(v.get("big"), Some(&Py::Int(1 << 62)));
        assert_eq!(v.get("s"), Some(&Py::List(vec![Py::Int(3)])));
        assert_eq!(v.get("by"), Some(&Py::Bytes(b"q".to_vec())));
    }

    #[test]
    fn bad_pickles_are_errors_not_panics() {
        assert!(matches!(load(b"\x80\x02}q\x00(X\x05\x00\x00\x00ab"), Err(PickleError::Truncated(_))));
        assert!(matches!(load(b"\x80\x02\xff."), Err(PickleError::Opcode { op: 0xff, .. })));
        assert!(matches!(load(b"\x80\x02h\x07."), Err(PickleError::Corrupt { .. })));
        assert!(matches!(load(b"\x80\x02u."), Err(PickleError::Corrupt { .. })));
        assert!(matches!(load(b""), Err(PickleError::Truncated(0))));
    }
}
