"""The GGUF key/value section as blockspec reads it (gguf.read_value, gguf.metadata_reader) against the
`gguf` package's own reader, on a file with every value type: the same values (an array of arrays
keeps its structure, which the package flattens), the same tensors."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from blockspec.gguf import GGUFError, metadata_reader, open_gguf  # noqa: E402


def write_every_type(path, alignment: int | None = None):
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_uint8("t.u8", 255)
    writer.add_int8("t.i8", -128)
    writer.add_uint16("t.u16", 65535)
    writer.add_int16("t.i16", -32768)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)                    # read back as the float32 nearest 0.1
    writer.add_uint64("t.u64", 2 ** 64 - 1)
    writer.add_int64("t.i64", -(2 ** 63))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.yes", True)
    writer.add_bool("t.no", False)
    writer.add_string("t.text", "naïve – 東京 😀")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [3, -1, 7])
    writer.add_array("t.floats", [0.5, -2.25])
    writer.add_array("t.strings", ["a", "", "Ġthe", "東京", "\n"])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.none", [])
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_reads_as_the_packages_reader_reads_it(tmp_path, alignment):
    path = write_every_type(tmp_path / "every.gguf", alignment)
    theirs = gguf.GGUFReader(str(path))
    ours = metadata_reader(gguf.GGUFReader)(str(path))
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert expected["t.nested"] == [1, 2, 3]            # the package flattens an array of arrays (its FIXME)
    expected["t.nested"] = [[1, 2], [3]]                # read_value keeps the structure the file has
    assert ours.metadata == expected
    assert [type(v) for v in ours.metadata.values()] == [type(v) for v in expected.values()]
    assert ours.metadata["t.f32"] == float(np.float32(0.1)) and ours.metadata["t.u64"] == 2 ** 64 - 1
    assert ours.metadata["t.strings"] == ["a", "", "Ġthe", "東京", "\n"] and ours.metadata["t.nested"] == [[1, 2], [3]]
    assert ours.alignment == theirs.alignment == (alignment or 32) and ours.data_offset == theirs.data_offset
    assert [(t.name, t.tensor_type, t.data.tolist()) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data.tolist()) for t in theirs.tensors]


def test_a_truncated_key_value_section_is_one_clear_error(tmp_path):
    path = write_every_type(tmp_path / "every.gguf")
    data = path.read_bytes()
    cut = data.index(b"t.strings") + 40                  # inside the array of strings
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        open_gguf(tmp_path / "cut.gguf")
