package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// TestFreeDelay: replaced bodies wait FreeDelay before their room comes
// back, all of them on the store's one timer, in waves that fall due at
// different times; one that a reader holds waits for the reader too.
func TestFreeDelay(t *testing.T) {
	const size = 4096
	t.Run("not before", func(t *testing.T) {
		s := newTestStore(t, 4<<20, noEvict(), withOptions(func(o *store.Options) { o.FreeDelay = time.Hour }))
		s.put(t, "k", pattern(1, size))
		s.put(t, "k", pattern(2, size))
		if st := s.Stats(); st.DelayedFree != int64(roundUp(size)) || s.used() != 2*roundUp(size) {
			t.Fatalf("right after the replace: %d B delayed, %d B used", st.DelayedFree, s.used())
		}
	})
	t.Run("waves", func(t *testing.T) {
		s := newTestStore(t, 8<<20, noEvict(), withOptions(func(o *store.Options) { o.FreeDelay = 50 * time.Millisecond }))
		const keys = 200
		for i := range keys {
			s.put(t, fmt.Sprint("k", i), pattern(byte(i), size))
		}
		r, err := s.OpenReader(context.Background(), "k7")
		if err != nil {
			t.Fatal(err)
		}
		for wave := range 3 {
			for i := wave; i < keys; i += 3 {
				s.put(t, fmt.Sprint("k", i), pattern(byte(i+1), size))
			}
			time.Sleep(20 * time.Millisecond)
		}
		// Every replaced body but k7's first comes back; k7's once its
		// reader closes.
		s.waitUsed(t, (keys+1)*roundUp(size))
		if got := s.read(t, "k7"); got[0] != pattern(8, size)[0] {
			t.Fatal("k7 is not its second value")
		}
		r.Close()
		s.waitUsed(t, keys*roundUp(size))
		if st := s.Stats(); st.DelayedFree != 0 {
			t.Fatalf("%d B still counted as delayed", st.DelayedFree)
		}
		s.checkAlloc(t)
	})
}
