#!/usr/bin/env python3
"""Refresh llmtap's embedded price table (data/prices.json) from pydantic's genai-prices on PyPI.

    python3 scripts/update-prices.py              # newest release
    python3 scripts/update-prices.py --version 0.2.3

Why PyPI: genai-prices publishes `prices/data.json` on GitHub, but llmtap's builders may only reach package
registries. The wheel carries the same data as Python source (`genai_prices/data.py`: constructor calls such as
`ModelInfo(...)`, `Decimal('3')`, `datetime.date(2025, 1, 1)`). We never import or execute that file: it is read
with `ast` and only literals and known constructor names are accepted, so a changed wheel fails loudly here
instead of silently producing a wrong table.

What is kept (see src/cost/mod.rs for how it is used): providers (id, provider_match, model_match,
fallback_model_providers) and models (id, match clause, prices per token kind incl. tiers, dated and
time-of-day price changes). Everything llmtap's `Usage` cannot express is dropped and listed in
data/prices.PROVENANCE.md (modality-specific prices, 1h cache writes, request-context price variants).

Needs only the Python standard library and `pip` (for `pip download`).
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "genai-prices"
REPO_ROOT = Path(__file__).resolve().parent.parent
# Price keys llmtap's Usage can be priced with: input/output plus the cache and reasoning subsets.
KEPT_PRICE_KEYS = ("input_mtok", "cache_read_mtok", "cache_write_mtok", "output_mtok", "output_reasoning_mtok")
# Licences we accept for data embedded in an Apache-2.0 binary.
COMPATIBLE_LICENCES = {"MIT", "Apache-2.0", "BSD-3-Clause", "BSD-2-Clause", "CC0-1.0"}


class Unsupported(Exception):
    """data.py contains something this script does not know how to read."""


def download_wheel(version: str | None, dest: Path) -> Path:
    spec = f"{PACKAGE}=={version}" if version else PACKAGE
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", spec, "-d", str(dest)],
        check=True,
    )
    wheels = sorted(dest.glob("genai_prices-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one wheel in {dest}, found {wheels}")
    return wheels[0]


def literal(node: ast.AST):
    """Turn one expression of data.py into plain JSON values without executing anything."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List) or isinstance(node, ast.Tuple):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {literal(k): literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -literal(node.operand)
    if isinstance(node, ast.Attribute) and ast.unparse(node) in ("datetime.UTC", "datetime.timezone.utc"):
        return "UTC"
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        args = [literal(a) for a in node.args]
        kwargs = {k.arg: literal(k.value) for k in node.keywords}
        if name == "Decimal":
            # Kept as a string: prices are exact decimals and must not pass through a float.
            return str(args[0])
        if name in ("datetime.date", "date"):
            return dt.date(*args).isoformat()
        if name in ("datetime.time", "time"):
            tz = kwargs.pop("tzinfo", "UTC")
            if tz != "UTC" or kwargs:
                raise Unsupported(f"time with {tz=} {kwargs=}")
            return dt.time(*args).isoformat()
        if name[:1].isupper() and "." not in name:
            if args:
                raise Unsupported(f"positional arguments to {name}")
            return {"__type__": name, **kwargs}
        raise Unsupported(f"call to {name}")
    raise Unsupported(ast.dump(node)[:200])


def read_providers(data_py: str) -> list[dict]:
    tree = ast.parse(data_py)
    for stmt in tree.body:
        if isinstance(stmt, ast.AnnAssign) and ast.unparse(stmt.target) == "providers":
            return literal(stmt.value)
    raise Unsupported("no `providers: list[Provider] = [...]` in data.py")


CLAUSES = {
    "ClauseEquals": "equals",
    "ClauseStartsWith": "starts_with",
    "ClauseEndsWith": "ends_with",
    "ClauseContains": "contains",
    "ClauseRegex": "regex",
}


def clause(c: dict | None):
    """A match clause as `{"equals": "..."}`, `{"or": [...]}`, ... (what the Rust side deserializes)."""
    if c is None:
        return None
    t = c["__type__"]
    if t in CLAUSES:
        return {CLAUSES[t]: c[CLAUSES[t]]}
    if t == "ClauseOr":
        return {"or": [clause(x) for x in c["or_"]]}
    if t == "ClauseAnd":
        return {"and": [clause(x) for x in c["and_"]]}
    raise Unsupported(f"clause {t}")


def price_value(v):
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and v.get("__type__") == "TieredPrices":
        return {"base": v["base"], "tiers": [{"start": t["start"], "price": t["price"]} for t in v["tiers"]]}
    raise Unsupported(f"price value {v!r}")


def model_price(p: dict, dropped: dict[str, int]) -> dict:
    if p.get("__type__") != "ModelPrice":
        raise Unsupported(f"prices {p.get('__type__')}")
    out = {}
    for key, value in p.items():
        if key == "__type__" or value is None:
            continue
        if key in KEPT_PRICE_KEYS:
            out[key] = price_value(value)
        else:
            dropped[key] = dropped.get(key, 0) + 1
    return out


def constraint(c: dict | None):
    if c is None:
        return None
    if c["__type__"] == "StartDateConstraint":
        return {"start_date": c["start_date"]}
    if c["__type__"] == "TimeOfDateConstraint":
        return {"start_time": c["start_time"], "end_time": c["end_time"]}
    raise Unsupported(f"constraint {c['__type__']}")


def model(m: dict, dropped: dict[str, int]) -> dict:
    prices = m.get("prices")
    if isinstance(prices, dict):
        periods = [{"constraint": None, "prices": model_price(prices, dropped)}]
    else:
        periods = []
        for cp in prices or []:
            if cp["__type__"] != "ConditionalPrice":
                raise Unsupported(f"price entry {cp['__type__']}")
            periods.append({"constraint": constraint(cp.get("constraint")), "prices": model_price(cp["prices"], dropped)})
    if m.get("price_variants"):
        dropped["price_variants (models)"] = dropped.get("price_variants (models)", 0) + 1
    return {"id": m["id"], "match": clause(m["match"]), "prices": periods}


def trim(providers: list[dict]) -> tuple[list[dict], dict[str, int]]:
    dropped: dict[str, int] = {}
    out = []
    for p in providers:
        out.append(
            {
                "id": p["id"],
                "provider_match": clause(p.get("provider_match")),
                "model_match": clause(p.get("model_match")),
                "fallback_model_providers": p.get("fallback_model_providers") or [],
                "models": [model(m, dropped) for m in p.get("models", [])],
            }
        )
    return out, dropped


def metadata_field(metadata: str, field: str) -> str | None:
    for line in metadata.splitlines():
        if not line.strip():
            break  # headers end at the first blank line; the rest is the README
        if line.startswith(f"{field}: "):
            return line.split(": ", 1)[1].strip()
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", help="genai-prices version (default: newest on PyPI)")
    ap.add_argument("--out-dir", type=Path, default=REPO_ROOT / "data")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_wheel(args.version, Path(tmp))
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            data_py = z.read("genai_prices/data.py").decode()
            dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
            metadata = z.read(f"{dist_info}/METADATA").decode()
            licence_text = z.read(next(n for n in names if n.startswith(f"{dist_info}/licenses/"))).decode()

    version = metadata_field(metadata, "Version")
    licence = metadata_field(metadata, "License-Expression") or metadata_field(metadata, "License")
    if licence not in COMPATIBLE_LICENCES:
        raise SystemExit(f"{PACKAGE} {version} is licensed {licence!r}: check compatibility before embedding it")

    providers, dropped = trim(read_providers(data_py))
    today = dt.date.today().isoformat()
    table = {
        "source": {"package": PACKAGE, "registry": "pypi", "version": version, "licence": licence, "fetched": today},
        "providers": providers,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # One provider per line-ish (indent=1): refreshes produce reviewable diffs without a 2 MB one-liner.
    (args.out_dir / "prices.json").write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n")
    (args.out_dir / "prices.LICENSE").write_text(licence_text)

    n_models = sum(len(p["models"]) for p in providers)
    dropped_lines = "\n".join(f"| `{k}` | {v} |" for k, v in sorted(dropped.items()))
    (args.out_dir / "prices.PROVENANCE.md").write_text(
        f"""# Provenance of data/prices.json

- Source: the `{PACKAGE}` package by Pydantic (https://github.com/pydantic/genai-prices), version **{version}**,
  wheel from PyPI (https://pypi.org/project/{PACKAGE}/{version}/), file `genai_prices/data.py`.
- Licence: **{licence}** (text copied to `data/prices.LICENSE`); compatible with llmtap's Apache-2.0.
- Fetched: {today}, by `scripts/update-prices.py` (reads data.py with `ast`, never executes it).
- Contents: {len(providers)} providers, {n_models} models. Prices are USD per million tokens, kept as decimal strings.

## Refresh

    python3 scripts/update-prices.py            # newest release; or --version X.Y.Z
    cargo test --test cost                       # hand-computed expectations may need updating if prices moved

Commit `data/prices.json`, this file and `data/prices.LICENSE` together.

## Dropped (llmtap's `Usage` cannot express them)

Modality-specific prices (audio/image/video tokens), 1-hour cache writes (llmtap does not see the TTL; cache writes
are priced at `cache_write_mtok`, the 5-minute rate) and request-context price variants (e.g. service tier) are not
kept. Count of model prices that carried each dropped key:

| key | count |
|---|---|
{dropped_lines}
"""
    )
    print(f"wrote {args.out_dir}/prices.json: {PACKAGE} {version} ({licence}), {len(providers)} providers, {n_models} models")


if __name__ == "__main__":
    main()
