#!/usr/bin/env bash
# The SmolLM2 GGUF (98 MB) onto the H200 machine, which reaches no registry: a call carries at most
# 64 MiB with the 32 MB tree, so the file travels xz-compressed (90 MB) in pieces, one a call,
# each call's piece kept in the machine's /tmp until the last one joins them (a warm machine keeps
# /tmp between calls).
#
#   here:   bash scripts/gguf_pieces.sh split [GGUF]      # .gguf/p0 … p3 (ignored; carry one a call)
#   device: bash scripts/gguf_pieces.sh keep              # this call's .gguf/p* into /tmp/gguf-pieces
#   device: bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf   # all pieces → the file, hash checked
# The first piece is the smallest: the first call also carries the wheels (.whl, 9 MB:
# scripts/device_wheels.sh). Round 41 carried 28 + 34 + 28.5 MB with 6 MB of wheels; round 44, beside a 33 MB
# tree, 24.6 + 33.9 + 32 MB; round 45, beside a 33.7 MB tree, 23.4 + 33.2 + 33.2 + 0.7 MB; round 51,
# beside 34.3 MB, 23 + 32.5 + 32.5 + 2.5 MB.
set -euo pipefail
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53   # blockspec/named.py's smollm2
KEEP=/tmp/gguf-pieces
case ${1:-} in
  split)
    gguf=${2:-$(python3 -c 'from blockspec import named; print(named.resolve("smollm2"))')}
    mkdir -p .gguf && rm -f .gguf/p*
    grep -qx '/.gguf/' .git/info/exclude 2>/dev/null || echo /.gguf/ >> .git/info/exclude
    xz -T2 -6 -c "$gguf" > .gguf/all.xz
    # Four pieces (p0 beside the wheels, then three beside the tree): each call carries at most
    # 64 MiB (67.1 MB), so the pieces are sized from today's tree and wheels (36.4 + 14.5 MB in round 66; round 66 was refused at 66.7 MB).
    tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    wheels=$(du -sb .whl 2>/dev/null | cut -f1); wheels=${wheels:-0}
    room=$(( 67100000 - tree - 2000000 ))   # a margin: the device counts more than these bytes
    first=$(( room - wheels ))
    dd if=.gguf/all.xz of=.gguf/p0 iflag=count_bytes count=$first status=none
    dd if=.gguf/all.xz of=.gguf/p1 iflag=skip_bytes,count_bytes skip=$first count=$room status=none
    dd if=.gguf/all.xz of=.gguf/p2 iflag=skip_bytes,count_bytes skip=$(( first + room )) count=$room status=none
    tail -c +$(( first + 2 * room + 1 )) .gguf/all.xz > .gguf/p3
    rm .gguf/all.xz
    ls -l .gguf ;;
  split2)
    # Two pieces, for calls whose tree leaves the demo pair's weights behind (untracked and
    # excluded for the device calls, round 51: a 14.5 MB tree): p0 beside the wheels, p1 alone.
    gguf=${2:-$(python3 -c 'from blockspec import named; print(named.resolve("smollm2"))')}
    mkdir -p .gguf && rm -f .gguf/p*
    grep -qx '/.gguf/' .git/info/exclude 2>/dev/null || echo /.gguf/ >> .git/info/exclude
    xz -T2 -6 -c "$gguf" > .gguf/all.xz
    dd if=.gguf/all.xz of=.gguf/p0 iflag=count_bytes count=${P0_BYTES:-42500000} status=none
    tail -c +$(( ${P0_BYTES:-42500000} + 1 )) .gguf/all.xz > .gguf/p1
    rm .gguf/all.xz
    ls -l .gguf ;;
  keep)
    mkdir -p $KEEP && cp .gguf/p* $KEEP/ && ls -l $KEEP ;;
  join)
    cat $(ls $KEEP/p* | sort) | xz -d > "$2"
    echo "$SHA  $2" | sha256sum -c - ;;
  *) echo "usage: $0 split [GGUF] | split2 [GGUF] | keep | join FILE" >&2; exit 2 ;;
esac
