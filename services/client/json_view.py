"""What `--json` prints for an API message: every field, and integers as numbers.

protobuf's JSON mapping (what REST answers, as FfDL's gateway did) leaves out a field at
its zero value and writes 64-bit integers as strings, so JavaScript loses no precision.
Neither suits a script reading the CLI: `jq 'select(.learner == 0)'` found no learner 0
(the key was absent) and `.step > 9` compared a string. So the CLI asks the library for
the zero fields and turns the 64-bit integers back into numbers (Python's are exact; jq's
are doubles, exact up to 2^53, beyond any step, count or size of ours).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def message_dict(msg: Message) -> dict[str, Any]:
    """`msg` as a JSON-ready dict, field names as in the .proto file."""
    data: dict[str, Any] = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _numbers(msg.DESCRIPTOR, data)
    return data


def _numbers(descriptor: Descriptor, data: dict[str, Any]) -> None:
    """Turn the 64-bit integer fields of `data` (a message of type `descriptor`, as
    MessageToDict made it) back into ints, in nested messages and lists too. The
    well-known types (Struct, Timestamp, ...) have JSON forms of their own: left as is."""
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.type in _INT64:
            data[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            inner = field.message_type
            if inner.full_name.startswith("google.protobuf.") or inner.GetOptions().map_entry:
                continue
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, dict):
                    _numbers(inner, item)
