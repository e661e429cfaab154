"""The consumers' step of a kernel's SASS dump (sass.py's, gzipped): the smallest loop
(a backward branch's span) that issues both of its ``wgmma`` products (the most
``HGMMA`` instructions of any loop; a branch that retries a wait can span the epilogue
and one product), with its instructions,
the sum of their stall cycles (the control bits' stall field) and its opcodes by count::

    python sass_loops.py sass_jaxtile_4096_full.txt.gz sass_tokamax_4096_full.txt.gz
"""

import collections
import gzip
import re
import sys

# "wait:read:write:yield:stall  /*address*/  instruction", as Mosaic GPU formats the control bits.
LINE = re.compile(r"^\s*(\S+):(\S):(\S):(\S):(\d+)\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;?\s*$")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


def instructions(path):
    """``[(address, stall, text)]`` and ``{label: address}`` of the dump's SASS."""
    rows, labels, pending = [], {}, []
    with gzip.open(path, "rt") as f:
        for line in f:
            if label := LABEL.match(line):
                pending.append(label.group(1))
            elif m := LINE.match(line):
                address = int(m.group(6), 16)
                labels.update((name, address) for name in pending)
                pending = []
                rows.append((address, int(m.group(5)), m.group(7)))
    return rows, labels


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main():
    for path in sys.argv[1:]:
        rows, labels = instructions(path)
        loops = []
        for address, _, text in rows:
            branch = BRANCH.search(text)
            start = labels.get(branch.group(1)) if branch else None
            if start is not None and start <= address:
                body = [row for row in rows if start <= row[0] <= address]
                loops.append((-sum(opcode(text) == "HGMMA" for _, _, text in body), len(body), body))
        body = min(loops, key=lambda loop: loop[:2])[2]
        ops = collections.Counter(opcode(text) for _, _, text in body)
        stall = sum(s for _, s, _ in body)
        print(f"{path}: {len(rows)} instructions; the step {body[0][0]:#06x}-{body[-1][0]:#06x}:")
        print(
            f"  {len(body)} instructions, {stall} stall cycles: "
            + ", ".join(f"{op} {n}" for op, n in ops.most_common())
        )


if __name__ == "__main__":
    main()
