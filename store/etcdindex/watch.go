package etcdindex

import (
	"context"
	"slices"
	"strings"
	"sync"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// watcher is one Watch call: an unbounded queue drained into out by run.
type watcher struct {
	prefix string
	out    chan store.Event
	wake   chan struct{}
	done   chan struct{}
	once   sync.Once
	mu     struct {
		sync.Mutex
		queue []store.Event
	}
}

func newWatcher(prefix string) *watcher {
	return &watcher{prefix: prefix, out: make(chan store.Event), wake: make(chan struct{}, 1), done: make(chan struct{})}
}

func (w *watcher) send(events []store.Event) {
	w.mu.Lock()
	for _, e := range events {
		if strings.HasPrefix(e.Object.Key, w.prefix) {
			w.mu.queue = append(w.mu.queue, e)
		}
	}
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *watcher) stop() { w.once.Do(func() { close(w.done) }) }

func (w *watcher) run(ctx context.Context) {
	defer close(w.out)
	for {
		w.mu.Lock()
		q := w.mu.queue
		w.mu.queue = nil
		w.mu.Unlock()
		for _, e := range q {
			select {
			case w.out <- e:
			case <-w.done:
				return
			case <-ctx.Done():
				return
			}
		}
		select {
		case <-w.wake:
		case <-w.done:
			return
		case <-ctx.Done():
			return
		}
	}
}

func slicesSortByVersion(events []store.Event) {
	slices.SortStableFunc(events, func(a, b store.Event) int {
		switch {
		case a.Object.Version < b.Object.Version:
			return -1
		case a.Object.Version > b.Object.Version:
			return 1
		}
		return 0
	})
}
