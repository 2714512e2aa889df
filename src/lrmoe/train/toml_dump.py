"""The resolved config written back as TOML next to a run's results (:meth:`RunConfig.to_dict`'s
tables), so the run can be repeated with ``--config``."""

from __future__ import annotations


def dump_toml(d: dict) -> str:
    """A minimal TOML writer for the resolved config (scalars, lists, nested tables)."""

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines: list[str] = []

    def table(prefix: str, t: dict) -> None:
        scalars = {k: v for k, v in t.items() if not isinstance(v, dict) and v is not None}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {value(v)}" for k, v in scalars.items())
        lines.append("")
        for k, v in t.items():
            if isinstance(v, dict):
                table(f"{prefix}.{k}" if prefix else k, v)

    table("", d)
    return "\n".join(lines).lstrip("\n")
