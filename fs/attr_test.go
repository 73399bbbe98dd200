package fs

import (
	"math"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// TestFileAttrSizes: st_blksize is 1 MiB for an empty or large file and
// the size rounded up to a power of two, at least 128 KiB, between; a
// file's blocks are whole pages, as tmpfs counts them.
func TestFileAttrSizes(t *testing.T) {
	f := &FS{}
	for _, c := range []struct {
		size    uint64
		blksize uint32
		blocks  uint64
	}{
		{0, 1 << 20, 0},
		{1, 128 << 10, 8},
		{4096, 128 << 10, 8},
		{4097, 128 << 10, 16},
		{128 << 10, 128 << 10, 256},
		{128<<10 + 1, 256 << 10, 264},
		{600 << 10, 1 << 20, 1200},
		{1 << 20, 1 << 20, 2048},
		{10 << 30, 1 << 20, 10 << 21},
	} {
		var a fuse.Attr
		f.fillAttr(&store.Object{Kind: store.KindFile}, c.size, &a)
		if a.Blksize != c.blksize || a.Blocks != c.blocks || a.Size != c.size {
			t.Errorf("size %d: blksize %d blocks %d, want %d and %d", c.size, a.Blksize, a.Blocks, c.blksize, c.blocks)
		}
	}
}

// TestUnixNanos: times past what int64 nanoseconds hold are clamped to
// its ends, not wrapped around (2300 read back as 1715).
func TestUnixNanos(t *testing.T) {
	for _, c := range []struct {
		t    time.Time
		want int64
	}{
		{time.Unix(1600000000, 5), 1600000000*1e9 + 5},
		{time.Unix(0, math.MaxInt64), math.MaxInt64},
		{time.Unix(0, math.MinInt64), math.MinInt64},
		{time.Date(2300, 1, 1, 0, 0, 0, 0, time.UTC), math.MaxInt64},
		{time.Date(1600, 1, 1, 0, 0, 0, 0, time.UTC), math.MinInt64},
		{time.Unix(1<<62, 0), math.MaxInt64},
		{time.Unix(-1<<62, 0), math.MinInt64},
	} {
		if got := unixNanos(c.t); got != c.want {
			t.Errorf("unixNanos(%v) = %d, want %d", c.t, got, c.want)
		}
	}
}
