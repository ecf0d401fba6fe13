"""`type: tensorboard`: scalars from TensorBoard event files, read without TensorBoard.

    evaluation_metrics:
      type: tensorboard
      in: logs/tb            # default; a directory searched recursively for
                             # events.out.tfevents.* files

Why our own reader: the `tensorboard` package is not a dependency of Rhizome (it is large
and brings a web server into every learner image), and reading scalars needs little: an
event file is a TFRecord file (length, masked CRC-32C of the length, an `Event` protobuf,
masked CRC-32C of the data), and an `Event` carries `Summary.Value`s whose scalar is
either `simple_value` (writers' classic form, e.g. torch's `add_scalar`) or a one-element
float/double/int `tensor` (the "new style"). `EVENT_DESCRIPTOR` below declares just those
fields of TensorFlow's event.proto/summary.proto/tensor.proto with their original field
numbers, so the fast protobuf parser does the decoding and skips everything else
(images, histograms, graphs).

A sample's name is the tag; for files in a sub-directory of `in` (one TensorBoard "run"
each, e.g. train/ and eval/), `<run>/<tag>`. The time is the event's wall time.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from learner.controller.metric_sources.api import MetricSource, Sample, register_source

_F = descriptor_pb2.FieldDescriptorProto


def _build_event_class() -> Any:
    fdp = descriptor_pb2.FileDescriptorProto(
        name="rhizome_tb_event_subset.proto", package="rhizome_tb", syntax="proto3"
    )

    def msg(name: str, fields: list[tuple[str, int, int, int, str]]) -> None:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name

    opt, rep = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
    msg(
        "TensorProto",
        [
            ("dtype", 1, _F.TYPE_INT32, opt, ""),
            ("tensor_content", 4, _F.TYPE_BYTES, opt, ""),
            ("float_val", 5, _F.TYPE_FLOAT, rep, ""),
            ("double_val", 6, _F.TYPE_DOUBLE, rep, ""),
            ("int_val", 7, _F.TYPE_INT32, rep, ""),
            ("int64_val", 10, _F.TYPE_INT64, rep, ""),
        ],
    )
    msg("PluginData", [("plugin_name", 1, _F.TYPE_STRING, opt, "")])
    msg("SummaryMetadata", [("plugin_data", 1, _F.TYPE_MESSAGE, opt, ".rhizome_tb.PluginData")])
    msg(
        "Value",
        [
            ("tag", 1, _F.TYPE_STRING, opt, ""),
            ("simple_value", 2, _F.TYPE_FLOAT, opt, ""),
            ("tensor", 8, _F.TYPE_MESSAGE, opt, ".rhizome_tb.TensorProto"),
            ("metadata", 9, _F.TYPE_MESSAGE, opt, ".rhizome_tb.SummaryMetadata"),
        ],
    )
    value = fdp.message_type[-1]
    # simple_value lives in a oneof in summary.proto; declaring it gives us HasField().
    value.oneof_decl.add(name="value")
    for f in value.field:
        if f.name in ("simple_value", "tensor"):
            f.oneof_index = 0
    msg("Summary", [("value", 1, _F.TYPE_MESSAGE, rep, ".rhizome_tb.Value")])
    msg(
        "Event",
        [
            ("wall_time", 1, _F.TYPE_DOUBLE, opt, ""),
            ("step", 2, _F.TYPE_INT64, opt, ""),
            ("file_version", 3, _F.TYPE_STRING, opt, ""),
            ("summary", 5, _F.TYPE_MESSAGE, opt, ".rhizome_tb.Summary"),
        ],
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("rhizome_tb.Event"))


Event = _build_event_class()

# -- TFRecord framing ------------------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class CorruptRecord(ValueError):
    pass


def read_records(buf: bytes, verify: bool = True) -> tuple[list[bytes], int]:
    """Complete records at the start of `buf` and how many bytes they take; a partial
    record at the end (a writer mid-write) is left for the next read."""
    out, pos, n = [], 0, len(buf)
    while n - pos >= 12:
        (length,) = struct.unpack_from("<Q", buf, pos)
        (len_crc,) = struct.unpack_from("<I", buf, pos + 8)
        if verify and masked_crc32c(buf[pos : pos + 8]) != len_crc:
            raise CorruptRecord(f"bad length checksum at byte {pos}")
        end = pos + 12 + length + 4
        if end > n:
            break
        data = buf[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack_from("<I", buf, pos + 12 + length)
        if verify and masked_crc32c(data) != data_crc:
            raise CorruptRecord(f"bad data checksum in the record at byte {pos}")
        out.append(data)
        pos = end
    return out, pos


def write_record(data: bytes) -> bytes:
    """One TFRecord frame (used by tests and tools that write event files)."""
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


_DT_FLOAT, _DT_DOUBLE, _DT_INT32, _DT_INT64 = 1, 2, 3, 9
_UNPACK = {_DT_FLOAT: "<f", _DT_DOUBLE: "<d", _DT_INT32: "<i", _DT_INT64: "<q"}


def scalar_of(value: Any) -> float | None:
    """The scalar of a Summary.Value, or None when it is not a scalar summary."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if not value.HasField("tensor"):
        return None
    plugin = value.metadata.plugin_data.plugin_name
    if plugin and plugin != "scalars":
        return None
    t = value.tensor
    for vals in (t.float_val, t.double_val, t.int64_val, t.int_val):
        if len(vals) == 1:
            return float(vals[0])
    fmt = _UNPACK.get(t.dtype)
    if fmt and len(t.tensor_content) == struct.calcsize(fmt):
        return float(struct.unpack(fmt, t.tensor_content)[0])
    return None


def parse_events(records: list[bytes], run: str = "") -> list[Sample]:
    out = []
    for data in records:
        ev = Event.FromString(data)
        if not ev.HasField("summary"):
            continue
        t_us = int(ev.wall_time * 1e6) if ev.wall_time else None
        for v in ev.summary.value:
            x = scalar_of(v)
            if x is not None:
                out.append(Sample(f"{run}/{v.tag}" if run else v.tag, x, int(ev.step), t_us))
    return out


class TensorboardSource(MetricSource):
    type = "tensorboard"
    rescan_s = 1.0

    def __init__(self, spec: Mapping[str, Any], learner_dir: Path, source_id: str) -> None:
        super().__init__(spec, learner_dir, source_id)
        self.root = self.resolve(str(spec.get("in", "logs/tb")))
        self.offsets: dict[str, int] = {}
        self.files: list[str] = []
        self.corrupt: dict[str, str] = {}
        self._last_scan = 0.0

    def _scan(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_scan < self.rescan_s:
            return
        self._last_scan = now
        if self.root.is_dir():
            found = (
                p.relative_to(self.root).as_posix()
                for p in self.root.rglob("events.out.tfevents.*")
            )
            self.files = sorted(set(found) | set(self.offsets))

    def poll(self, final: bool, max_records: int) -> list[Sample]:
        self._scan(force=final)
        out: list[Sample] = []
        for rel in self.files:
            if rel in self.corrupt:
                continue
            off = self.offsets.get(rel, 0)
            try:
                with open(self.root / rel, "rb") as f:
                    f.seek(off)
                    buf = f.read(4 << 20)
            except FileNotFoundError:
                continue
            try:
                records, used = read_records(buf)
            except CorruptRecord as exc:
                # Stop at the damage; what came before it has been read.
                self.corrupt[rel] = str(exc)
                continue
            if not records:
                continue
            parent = Path(rel).parent.as_posix()
            out.extend(parse_events(records, "" if parent == "." else parent))
            self.offsets[rel] = off + used
            if len(out) >= max_records:
                break
        return out

    def state(self) -> dict[str, Any]:
        return {"offsets": dict(self.offsets)}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.offsets = {str(k): int(v) for k, v in (state.get("offsets") or {}).items()}
        self._scan(force=True)


register_source("tensorboard", TensorboardSource)
