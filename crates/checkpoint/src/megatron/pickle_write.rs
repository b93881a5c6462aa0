//! A value tree written as a pickle (protocol 2 opcodes, as `torch.save` writes its data.pkl;
//! `BINBYTES` for bytes, which every Python 3 reads): the inverse of `pickle::load`, so the
//! exports to Megatron-LM write the same trees the imports read. No memo is written: nothing
//! exported is shared between two places, and Python rebuilds each subtree as written.
//!
//! An `Object` is written as a call: `NEWOBJ` (`cls.__new__(cls)`, how Python pickles a plain
//! class or a dataclass) when it has no arguments and a state to `BUILD` from, `REDUCE`
//! (`callable(*args)`) otherwise; then its dict items, list elements and state.

use super::pickle::Py;

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const BINBYTES: u8 = b'B';
const EMPTY_TUPLE: u8 = b')';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const EMPTY_LIST: u8 = b']';
const APPENDS: u8 = b'e';
const EMPTY_DICT: u8 = b'}';
const SETITEMS: u8 = b'u';
const GLOBAL: u8 = b'c';
const BINPERSID: u8 = b'Q';
const REDUCE: u8 = b'R';
const NEWOBJ: u8 = 0x81;
const BUILD: u8 = b'b';

/// `v` as a pickle.
pub fn dump(v: &Py) -> Vec<u8> {
    let mut out = vec![PROTO, 2];
    write(&mut out, v);
    out.push(STOP);
    out
}

fn write(out: &mut Vec<u8>, v: &Py) {
    match v {
        Py::None => out.push(NONE),
        Py::Bool(b) => out.push(if *b { NEWTRUE } else { NEWFALSE }),
        Py::Int(i) => int(out, *i),
        Py::Float(f) => {
            out.push(BINFLOAT);
            out.extend_from_slice(&f.to_be_bytes());
        }
        Py::Str(s) => sized(out, BINUNICODE, s.as_bytes()),
        Py::Bytes(b) => sized(out, BINBYTES, b),
        Py::Tuple(t) => tuple(out, t),
        Py::List(l) => {
            out.push(EMPTY_LIST);
            marked(out, l.iter(), APPENDS);
        }
        Py::Dict(items) => {
            out.push(EMPTY_DICT);
            setitems(out, items);
        }
        Py::Global(module, name) => {
            out.push(GLOBAL);
            for part in [module, name] {
                out.extend_from_slice(part.as_bytes());
                out.push(b'\n');
            }
        }
        Py::Persistent(pid) => {
            write(out, pid);
            out.push(BINPERSID);
        }
        Py::Object { callable, args, state, items, elems } => {
            write(out, callable);
            tuple(out, args);
            out.push(if args.is_empty() && state.is_some() { NEWOBJ } else { REDUCE });
            setitems(out, items);
            marked(out, elems.iter(), APPENDS);
            if let Some(s) = state {
                write(out, s);
                out.push(BUILD);
            }
        }
    }
}

fn int(out: &mut Vec<u8>, i: i64) {
    if let Ok(b) = u8::try_from(i) {
        out.extend_from_slice(&[BININT1, b]);
    } else if let Ok(h) = u16::try_from(i) {
        out.push(BININT2);
        out.extend_from_slice(&h.to_le_bytes());
    } else if let Ok(w) = i32::try_from(i) {
        out.push(BININT);
        out.extend_from_slice(&w.to_le_bytes());
    } else {
        // Two's complement, little-endian, in eight bytes (Python takes any length).
        out.extend_from_slice(&[LONG1, 8]);
        out.extend_from_slice(&i.to_le_bytes());
    }
}

fn sized(out: &mut Vec<u8>, op: u8, bytes: &[u8]) {
    out.push(op);
    let n = u32::try_from(bytes.len()).expect("a pickled string or bytes over 4 GiB");
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(bytes);
}

fn tuple(out: &mut Vec<u8>, t: &[Py]) {
    match t.len() {
        0 => out.push(EMPTY_TUPLE),
        1..=3 => {
            t.iter().for_each(|x| write(out, x));
            out.push(TUPLE1 + t.len() as u8 - 1);
        }
        _ => {
            out.push(MARK);
            t.iter().for_each(|x| write(out, x));
            out.push(TUPLE);
        }
    }
}

/// `MARK x… op` for the values of a non-empty sequence (a list's APPENDS).
fn marked<'a>(out: &mut Vec<u8>, mut xs: impl ExactSizeIterator<Item = &'a Py>, op: u8) {
    if xs.len() == 0 {
        return;
    }
    out.push(MARK);
    xs.by_ref().for_each(|x| write(out, x));
    out.push(op);
}

fn setitems(out: &mut Vec<u8>, items: &[(Py, Py)]) {
    if items.is_empty() {
        return;
    }
    out.push(MARK);
    for (k, v) in items {
        write(out, k);
        write(out, v);
    }
    out.push(SETITEMS);
}

#[cfg(test)]
mod tests {
    use super::super::pickle::load;
    use super::*;

    /// Every kind of value, written and read back by this crate's reader.
    #[test]
    fn values_read_back_as_written() {
        let ints = [0, 1, 255, 256, 65535, 65536, -1, -129, i32::MAX as i64, i32::MIN as i64, 1 << 40, i64::MIN];
        let object = |args: Vec<Py>, state: Option<Py>, items: Vec<(Py, Py)>, elems: Vec<Py>| Py::Object {
            callable: Box::new(Py::Global("argparse".into(), "Namespace".into())),
            args,
            state: state.map(Box::new),
            items,
            elems,
        };
        let v = Py::Dict(vec![
            (Py::Str("ints".into()), Py::List(ints.iter().map(|&i| Py::Int(i)).collect())),
            (Py::Str("floats".into()), Py::Tuple(vec![Py::Float(0.1), Py::Float(-3e-300), Py::Float(f64::INFINITY)])),
            (Py::Str("strs ü".into()), Py::Tuple(vec![Py::Str(String::new()), Py::Str("naïve".into())])),
            (Py::Str("small tuples".into()), Py::Tuple(vec![Py::Tuple(vec![]), Py::Tuple(vec![Py::None])])),
            (Py::Str("bytes".into()), Py::Bytes(vec![0, 1, 254])),
            (Py::Int(7), Py::Bool(true)),
            (Py::Str("dtype".into()), Py::Global("torch".into(), "bfloat16".into())),
            (Py::Str("pid".into()), Py::Persistent(Box::new(Py::Tuple(vec![Py::Str("storage".into()), Py::Int(3)])))),
            (
                Py::Str("new".into()),
                object(vec![], Some(Py::Dict(vec![(Py::Str("a".into()), Py::Bool(false))])), vec![], vec![]),
            ),
            (Py::Str("reduce".into()), object(vec![Py::Int(1), Py::Str("x".into())], None, vec![], vec![])),
            (Py::Str("filled".into()), object(vec![], None, vec![(Py::Str("k".into()), Py::Int(2))], vec![Py::None])),
        ]);
        assert_eq!(load(&dump(&v)).unwrap(), v);
    }

    /// The opcodes Python itself writes for these values at protocol 2 (less its memo puts).
    #[test]
    fn bytes_are_pythons() {
        let v = Py::Dict(vec![(Py::Str("a".into()), Py::Tuple(vec![Py::Int(1), Py::Int(300), Py::Float(0.5)]))]);
        let mut want = b"\x80\x02}(X\x01\x00\x00\x00aK\x01M\x2c\x01G".to_vec();
        want.extend_from_slice(&0.5f64.to_be_bytes());
        want.extend_from_slice(b"\x87u.");
        assert_eq!(dump(&v), want);
    }
}
