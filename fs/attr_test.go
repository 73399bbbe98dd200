package fs

import (
	"testing"

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
