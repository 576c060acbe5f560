"""The options of ``fuel plan --tp/--pp/--ep/--nodes`` turned into the report's ``parallel``
object: the layout (refused when it does not divide the model or the servers), the
interconnects (the device's default or ``--interconnect``; ``--network`` between servers) and
the Hugging Face id the ``vllm serve`` line names."""

from __future__ import annotations

from typing import Any

from fuel.errors import InputError


def parallel_doc(model: str | None, circuit: Any, spec: Any, info: Any, choice: Any, policy: Any,
                 options: Any, *, tp: int, pp: int, ep: bool, nodes: int,
                 interconnect: str | None, network: str, utilization: float) -> dict[str, Any]:
    from fuel.circuit import zoo
    from fuel.circuit.parallel import Parallel, split_shape
    from fuel.cost.interconnect import default_intra_node
    from fuel.cost.interconnect import interconnect as link_named
    from fuel.report.parallel import Links, parallel_report

    layout = Parallel(tp=tp, pp=pp, ep=tp if ep else 1)
    if layout.world % nodes:
        raise InputError("--nodes", "nodes", f"{layout.world} ranks (tp x pp) do not spread evenly "
                                             f"over {nodes} servers")
    if circuit.shape is None:
        raise InputError("--circuit", "shape", "a parallel plan needs the model's config")
    split_shape(circuit.shape, layout)
    intra = link_named(interconnect) if interconnect else default_intra_node(spec.name)
    inter = link_named(network) if nodes > 1 else None
    model_id = model or "MODEL"
    if model is not None and model in zoo.names():
        model_id = zoo.entry(model).hf or model
    return parallel_report(circuit, info, choice, policy, options, layout,
                           Links(intra, inter, nodes), model_id=model_id, utilization=utilization)
