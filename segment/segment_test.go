package segment

import "testing"

func TestSegmentBytes(t *testing.T) {
	mem := make([]byte, 3*Granule+100)
	for i := range mem {
		mem[i] = byte(i)
	}
	s := NewSegment(7, mem)
	if got := s.Alloc.Size(); got != pg(3) {
		t.Fatalf("allocator size %d, want %d", got, pg(3))
	}
	for _, tc := range []struct {
		e    Extent
		ok   bool
		want int // len
	}{
		{Extent{7, 0, Granule}, true, Granule},
		{Extent{7, Granule, 2 * Granule}, true, 2 * Granule},
		{Extent{7, 3 * Granule, 100}, true, 100}, // the ragged tail is memory, just never allocated
		{Extent{7, uint64(len(mem)), 0}, true, 0},
		{Extent{7, 10, 5}, true, 5},
		{Extent{7, 3 * Granule, 101}, false, 0},
		{Extent{7, uint64(len(mem)) + 1, 0}, false, 0},
		{Extent{7, 1, ^uint64(0)}, false, 0},
		{Extent{7, ^uint64(0), 2}, false, 0}, // Off+Len wraps
		{Extent{8, 0, Granule}, false, 0},    // another segment's extent
	} {
		b := s.Bytes(tc.e)
		if (b != nil) != tc.ok || len(b) != tc.want {
			t.Errorf("Bytes(%v): len %d nil=%v, want ok=%v len %d", tc.e, len(b), b == nil, tc.ok, tc.want)
			continue
		}
		if !tc.ok {
			continue
		}
		if cap(b) != len(b) {
			t.Errorf("Bytes(%v): cap %d, want %d", tc.e, cap(b), len(b))
		}
		if len(b) > 0 && b[0] != byte(tc.e.Off) {
			t.Errorf("Bytes(%v) does not alias the segment's memory", tc.e)
		}
	}
}
