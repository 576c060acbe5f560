"""Circuit-file load errors (SPEC §A2): each names the file and the key."""

from pathlib import Path

import pytest

from fuel.circuit.ir import OpKind
from fuel.circuit.template import CircuitLoadError, LayoutKind, load_circuit

BUILTIN = Path(__file__).resolve().parents[2] / "src" / "fuel" / "data" / "circuits"


def load_error(path: Path) -> CircuitLoadError:
    with pytest.raises(CircuitLoadError) as caught:
        load_circuit(path)
    return caught.value


def assert_names(error: CircuitLoadError, file: Path, key: str) -> None:
    assert error.file == str(file) and error.key == key
    assert str(file) in str(error) and f"`{key}`" in str(error)


def test_the_tiny_circuit_loads_with_its_library(tiny_circuit):
    template = load_circuit(tiny_circuit())
    assert [b.name for b in template.blocks] == ["embed", "head", "mix"]
    assert template.dims == {"hidden", "vocab"} and template.layout.kind is LayoutKind.INTERVAL
    assert template.block("mix").nodes[1].op.name() == "linear:o"


@pytest.mark.parametrize("name", ["dense_gqa", "moe_gqa"])
def test_builtin_circuits_load_and_every_op_is_in_the_closed_set(name):
    template = load_circuit(BUILTIN / f"{name}.toml")
    ops = {node.op.kind for block in template.blocks for node in block.nodes}
    assert ops <= set(OpKind) and OpKind.PAGED_ATTENTION in ops
    assert template.draft and template.draft_module == "model.layers.0"


@pytest.mark.parametrize("old,new,key", [
    ('description = "embed', 'colour = "red"\ndescription = "embed', "colour"),
    ("schema = 1", "schema = 2", "schema"),
    ('op = "linear"', 'op = "matmul"', "block.mix.node[1].op"),
    ('role = "o"\n', "", "block.mix.node[1].role"),
    ('id = "norm"', 'id = "norm"\nformat = "bf16"', "block.mix.node[0].format"),
    ('id = "norm"', 'id = "norm"\ncolour = "red"', "block.mix.node[0].colour"),
    ('shape = "n x hidden" }]\nbinding = ["{L}.norm', 'shape = "n x hiden" }]\nbinding = ["{L}.norm',
     "block.mix.node[0].out[0].shape"),
    ('shape = "n x hidden" }]\nbinding = ["{L}.norm', 'shape = "hidden x hidden" }]\nbinding = ["{L}.norm',
     "block.mix.node[0].out[0].shape"),
    ('shape = "n x hidden" }]\nbinding = ["{L}.norm', 'shape = "n x 2hidden" }]\nbinding = ["{L}.norm',
     "block.mix.node[0].out[0].shape"),
    ('shape = "n x hidden" }]\nbinding = ["{L}.norm',
     'shape = "n x 99999999999999999999*hidden" }]\nbinding = ["{L}.norm',
     "block.mix.node[0].out[0].shape"),
    ('edge = "h", format = "bf16"', 'edge = "h", format = "fp8/channel"', "block.mix.node[0].out[0].format"),
    ('edge = "h", format = "bf16"', 'edge = "h", format = "fp9"', "block.mix.node[0].out[0].format"),
    ('binding = ["{L}.proj.weight"]\n', "", "block.mix.node[1].binding"),
    ('include = ["tiny_lib"]', 'include = ["nolib"]', "include[0]"),
    ('kind = "interval"', 'kind = "spiral"', "layout.kind"),
    ('full_attention = ["mix"]', 'full_attention = ["mixer"]', "layout.blocks.full_attention[0]"),
    ('full_attention = ["mix"]', 'full_attentionn = ["mix"]', "layout.blocks.full_attentionn"),
    ('stream_out = "out"', 'stream_out = "nope"', "block.mix.stream_out"),
    ('draft_module = "layers.0"\n', "", "draft_module"),
    ('[block.mix]', '[variant.slot]\nparam = "p"\ncases = { a = "missing" }\n\n[block.mix]',
     "variant.slot.cases.a"),
])
def test_circuit_load_errors_name_file_and_key(tiny_circuit, old, new, key):
    path = tiny_circuit(old, new)
    assert_names(load_error(path), path, key)


def test_an_unused_block_template_is_refused(tiny_circuit):
    path = tiny_circuit("[block.mix]\n", "[block.spare]\nstream_in = \"x\"\n[[block.spare.node]]\n"
                        "id = \"c\"\nop = \"copy\"\nin = [\"x\"]\n\n[block.mix]\n")
    error = load_error(path)
    assert_names(error, path, "block.spare")
    assert "unused block template" in str(error)


def test_a_library_error_names_the_library_file(tiny_circuit):
    path = tiny_circuit(lib=('op = "lm_head"', 'op = "lm_tail"'))
    error = load_error(path)
    assert_names(error, path.parent / "tiny_lib.toml", "block.head.node[0].op")


def test_a_block_defined_twice_is_refused(tiny_circuit):
    path = tiny_circuit("[block.mix]\n", "[block.head]\nstream_in = \"x\"\n[[block.head.node]]\n"
                        "id = \"c\"\nop = \"copy\"\nin = [\"x\"]\n\n[block.mix]\n")
    assert_names(load_error(path), path, "block.head")


def test_malformed_toml_names_the_file(tiny_circuit):
    path = tiny_circuit("schema = 1", "schema = = 1")
    error = load_error(path)
    assert str(path) in str(error) and "not valid TOML" in str(error)
