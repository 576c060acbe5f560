"""JSON Schema validation of fuel's documents with each schema checked once per session.

``jsonschema.validate(doc, schema)`` checks the schema itself (against the metaschema) on every
call before validating the document, which costs more than the validation; here the schema is
checked on first use and its validator kept. A document that ``jsonschema.validate`` refuses is
refused here too (the first error is raised rather than the best match)."""

from __future__ import annotations

from functools import cache
from typing import Any

import jsonschema


@cache
def validator(name: str = "plan_report") -> Any:
    from fuel.report import load_schema

    schema = load_schema(name)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate(document: Any, name: str = "plan_report") -> None:
    """Raise :class:`jsonschema.ValidationError` unless ``document`` follows schema ``name``."""
    validator(name).validate(document)
