"""The warp stall samples of an `ncu --page source --print-source sass --csv` export (what
`device_check.sh indexer-ncu` writes as indexer_ncu_topk_sass.csv): the samples per stall
reason, and the SASS instructions with the most samples, each with its two main reasons.

    python dev/ncu_stalls.py indexer_ncu_topk_sass.csv [--top 25]
"""
import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def read(path):
    """(header, rows) of the export's instruction table."""
    rows = list(csv.reader(open(path)))
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    return rows[start], [row for row in rows[start + 1:] if len(row) == len(rows[start])]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    header, rows = read(args.csv)
    column = {name: i for i, name in enumerate(header)}
    number = lambda row, name: float(row[column[name]] or 0)  # noqa: E731
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    total = sum(number(row, SAMPLES) for row in rows)
    print(f"{len(rows)} instructions, {total:.0f} samples")
    by_reason = collections.Counter({r: sum(number(row, r) for row in rows) for r in reasons})
    for reason, count in by_reason.most_common(8):
        print(f"  {reason:28s} {count:8.0f}  {count / max(total, 1):6.1%}")
    for row in sorted(rows, key=lambda row: -number(row, SAMPLES))[:args.top]:
        main_reasons = sorted(reasons, key=lambda r: -number(row, r))[:2]
        print(f"{row[column['Address']]} {number(row, SAMPLES):6.0f}  "
              f"{row[column['Source']].strip()[:60]:60s} "
              + ", ".join(f"{r[6:]} {number(row, r):.0f}" for r in main_reasons))


if __name__ == "__main__":
    main()
