package store_test

import (
	"testing"

	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/store/indextest"
)

func TestEmbeddedConformance(t *testing.T) {
	indextest.Run(t, func(t *testing.T) store.Index {
		x := store.NewEmbedded()
		t.Cleanup(func() { _ = x.Close() })
		return x
	})
}
