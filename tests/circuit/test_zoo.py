"""The model zoo: every model instantiates; parameter estimates match published counts."""

import pytest

from fuel.circuit import zoo
from fuel.circuit.zoo import UnknownModel


def test_the_zoo_has_at_least_ten_models_with_sources():
    names = zoo.names()
    assert len(names) >= 10 and zoo.DEFAULT_MODEL in names
    for name in names:
        entry = zoo.entry(name)
        assert entry.hf and entry.found, f"{name} has no recorded source"
        assert name == name.lower()


@pytest.mark.parametrize("name", zoo.names())
def test_every_zoo_model_instantiates(name):
    circuit = zoo.load(name)
    shape = circuit.shape
    layers = {b.layer for b in circuit.blocks if b.layer is not None}
    assert layers == set(range(shape.layers))


def test_llama_31_70b_has_80_layers():
    assert zoo.shape("llama-3.1-70b").layers == 80


# Published totals: Llama-3.1-8B 8,030,261,248 and 70B 70,553,706,496 (a training-memory
# calculator's fixtures, index id 1597437933); SmolLM2-135M 134,515,008 (the model printout
# with its parameter count, index id 32455597214).
@pytest.mark.parametrize("name,published", [("llama-3.1-8b", 8_030_261_248),
                                            ("llama-3.1-70b", 70_553_706_496),
                                            ("smollm2-135m", 134_515_008)])
def test_parameter_estimate_matches_published_count(name, published):
    assert zoo.parameter_count(zoo.shape(name)) == published


# Published totals quoted to one decimal: Mixtral 46.7B (Mistral's release notes),
# Qwen3-30B-A3B 30.5B and Qwen1.5-MoE-A2.7B 14.3B (their model cards).
@pytest.mark.parametrize("name,billions", [("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5),
                                           ("qwen1.5-moe-a2.7b-chat", 14.3)])
def test_moe_parameter_estimate_matches_published_total(name, billions):
    assert round(zoo.parameter_count(zoo.shape(name)) / 1e9, 1) == billions


def test_an_unknown_model_lists_the_known_ones():
    with pytest.raises(UnknownModel, match="llama-3.1-8b"):
        zoo.entry("llama-9")
