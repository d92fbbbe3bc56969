"""The order of a kernel's instructions in its PTX, for tests that check where a schedule put
something (a multiply between two GEMMs, a store before a wait): selected instructions as
runs of tokens, e.g. ``W80x16 Cx1 mulx128 W256x5``."""

import re

# token maker per instruction kind; a line matching none is skipped
WGMMA = ("wgmma.mma_async", lambda line: "W" + re.search(r"m64n(\d+)k16", line).group(1))
COMMIT = ("wgmma.commit", lambda line: "C")
WAIT = ("wgmma.wait_group", lambda line: "wait" + line.split()[-1].rstrip(";"))
MUL_F32 = ("mul.", lambda line: "mul" if ".f32" in line else None)
STMATRIX = ("stmatrix", lambda line: "stm")
BARRIER = (("bar.sync", "barrier.sync"), lambda line: "bar")


def runs(ptx: str, *kinds) -> str:
    """The PTX's instructions of ``kinds`` (prefix, token maker) as ``<token>x<count>`` runs."""
    out = []
    for line in ptx.splitlines():
        line = line.strip()
        tok = next((make(line) for prefix, make in kinds if line.startswith(prefix)), None)
        if tok is None:
            continue
        if out and out[-1][0] == tok:
            out[-1][1] += 1
        else:
            out.append([tok, 1])
    return " ".join(f"{tok}x{n}" for tok, n in out)
