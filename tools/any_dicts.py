"""Count ``dict[str, Any]`` in the library and the CLI, by where it stands (the typed-seams rule, docs/DESIGN.md).

    python tools/any_dicts.py [--list]

Three places are told apart:
- *JSON I/O*: functions that turn records into JSON documents or back (``to_dict``, ``from_dict``,
  ``to_record``, ``from_record``, ``to_json``, ``from_json``, strict parsers and decoders), and ``jsonx``;
- *other libraries' protocols*: what torch, Hugging Face, Lightning, DCP or fsspec define as a plain dict
  (``state_dict``/``load_state_dict``, a Trainer's batch, Lightning's checkpoint dict, ``storage_options``);
- *inside*: everything else, the number the rule bounds (:data:`BOUND`).

Exits 1 when *inside* is above the bound (``make lint`` runs it).
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

PATTERN = "dict[str, Any]"
JSON_IO = re.compile(r"^(to_dict|to_row|from_dict|to_record|from_record|to_json|from_json|decode\w*|encoded|parse\w*|seal|"
                     r"_untrusted|_check_\w+|_tensors|_topology_problem|_fp|_info|objects|_mapping|encode\w*|run_meta|write_run_meta)$")
PROTOCOL = re.compile(r"^(state_dict|load_state_dict|training_step|_loss_of|save_checkpoint|load_checkpoint|"
                      r"_state|save|load|_values|write_data|read_metadata|run|modified|stamp)$")
JSON_CLASSES = re.compile(r"^_Fields$")  # a strict parser's typed field access over one decoded document
JSON_MODULES = {"jsonx.py"}
# The count when the rule went into `make lint`. It only goes down: a change that types a dict lowers it here in the
# same commit; a new untyped dict inside the library is a record to declare instead (docs/DESIGN.md, typed seams).
BOUND = 58


def places(path: pathlib.Path) -> list[tuple[int, str, str]]:
    text = path.read_text()
    lines = text.splitlines()
    owner: dict[int, str] = {}
    parser: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for ln in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                owner[ln] = node.name  # the innermost function wins: ast.walk visits outer ones first
        elif isinstance(node, ast.ClassDef) and JSON_CLASSES.match(node.name):
            parser.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    out = []
    for i, line in enumerate(lines, 1):
        for _ in range(line.count(PATTERN)):
            fn = owner.get(i, "")
            if path.name in JSON_MODULES or JSON_IO.match(fn) or i in parser:
                where = "json"
            elif "storage_options" in line or "options:" in line or PROTOCOL.match(fn):
                where = "protocol"
            else:
                where = "inside"
            out.append((i, where, fn))
    return out


def main(argv: list[str]) -> int:
    counts = {"json": 0, "protocol": 0, "inside": 0}
    for root in ("verified_ckpt", "cli"):
        for p in sorted(pathlib.Path(root).rglob("*.py")):
            for line, where, fn in places(p):
                counts[where] += 1
                if "--list" in argv and where == "inside":
                    print(f"{p}:{line}: {fn or '<module>'}")
    print(f"dict[str, Any]: {sum(counts.values())} in all; {counts['json']} at JSON I/O, {counts['protocol']} in other "
          f"libraries' protocols, {counts['inside']} inside (bound {BOUND})")
    if counts["inside"] > BOUND:
        print(f"{counts['inside'] - BOUND} dict[str, Any] inside the library over the bound of {BOUND}: declare a typed "
              "record instead (`python tools/any_dicts.py --list` names each place)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
