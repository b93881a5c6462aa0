//! The torch.save reader against a file PyTorch wrote (tests/fixtures/torch_views.pt, see
//! make_torch_views.py): views of one storage (a transpose, an offset slice), several dtypes, a
//! Parameter, a 0-d tensor, and an entry that is no tensor.

use ferrotron_checkpoint::megatron::{Py, TensorRef, TorchDtype, TorchFile};
use std::path::Path;

#[test]
fn views_and_dtypes_read_as_pytorch_wrote_them() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch_views.pt");
    let f = std::fs::File::open(&path).unwrap();
    let mut tf = TorchFile::new(std::io::BufReader::new(f), &path).unwrap();
    let state = tf.object().unwrap();
    let mut read = |name: &str| {
        let t = TensorRef::of(state.get(name).unwrap()).unwrap_or_else(|| panic!("{name} is a tensor"));
        (t.shape.clone(), t.dtype, tf.read(&t).unwrap())
    };
    let base: Vec<f32> = (0..12).map(|x| x as f32).collect();
    assert_eq!(read("whole"), (vec![3, 4], TorchDtype::F32, base.clone()));
    let transposed: Vec<f32> = (0..4).flat_map(|c| (0..3).map(move |r| (r * 4 + c) as f32)).collect();
    assert_eq!(read("transposed"), (vec![4, 3], TorchDtype::F32, transposed));
    assert_eq!(read("sliced"), (vec![2, 2], TorchDtype::F32, vec![5.0, 6.0, 9.0, 10.0]));
    assert_eq!(read("bf16"), (vec![3], TorchDtype::BF16, vec![1.5, -2.25, 3.0]));
    assert_eq!(read("f16"), (vec![2, 1], TorchDtype::F16, vec![0.5, 65504.0]));
    assert_eq!(read("f64"), (vec![1], TorchDtype::F64, vec![1e-3]));
    assert_eq!(read("i64"), (vec![2], TorchDtype::I64, vec![7.0, -9.0]));
    assert_eq!(read("param"), (vec![2], TorchDtype::F32, vec![4.0, 5.0]));
    assert_eq!(read("scalar"), (vec![], TorchDtype::F32, vec![2.5]));
    assert_eq!(state.get("note"), Some(&Py::Str("not a tensor".into())));
    assert!(TensorRef::of(state.get("note").unwrap()).is_none());
}

#[test]
fn a_view_past_its_storage_and_a_file_that_is_no_archive_are_errors() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch_views.pt");
    let f = std::fs::File::open(&path).unwrap();
    let mut tf = TorchFile::new(std::io::BufReader::new(f), &path).unwrap();
    let state = tf.object().unwrap();
    let mut t = TensorRef::of(state.get("whole").unwrap()).unwrap();
    t.shape = vec![4, 4];
    let e = tf.read(&t).unwrap_err().to_string();
    assert!(e.contains("too short") && e.contains("torch_views.pt"), "{e}");
    let e = TorchFile::new(std::io::Cursor::new(b"not a zip".to_vec()), Path::new("x.pt")).err().unwrap().to_string();
    assert!(e.contains("x.pt") && e.contains("not a torch.save"), "{e}");
}
