package store

import (
	"context"
	"strings"
	"sync"
)

// WatchHub fans committed events out to the watches of an Index. Each
// watch has its own unbounded queue, drained into its channel by a
// goroutine, so a slow reader never blocks commits. Index implementations
// publish under their own lock, which gives every watch the commit order.
type WatchHub struct {
	mu     sync.Mutex
	ws     map[*watcher]struct{}
	closed bool
}

// Watch registers a watch of keys starting with prefix until ctx ends or
// the hub closes; then the channel is closed.
func (h *WatchHub) Watch(ctx context.Context, prefix string) (<-chan Event, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, ErrClosed
	}
	if h.ws == nil {
		h.ws = make(map[*watcher]struct{})
	}
	w := &watcher{prefix: prefix, q: NewQueue[Event]()}
	h.ws[w] = struct{}{}
	go func() {
		select {
		case <-ctx.Done():
		case <-w.q.Done():
		}
		h.mu.Lock()
		delete(h.ws, w)
		h.mu.Unlock()
		w.q.Stop()
	}()
	go w.q.Run(ctx)
	return w.q.Out(), nil
}

// Watched reports whether any watch is registered: an index need not
// build events for no one. Call it under the lock that Publish is
// called under, so that a watch registered under it too is seen.
func (h *WatchHub) Watched() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.ws) > 0
}

// Publish queues events, in commit order, for every watch whose prefix
// matches. Events of one commit share Rev and must come in one call; each
// watch sees Last on the last event of each commit it receives.
func (h *WatchHub) Publish(events []Event) {
	if len(events) == 0 {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for w := range h.ws {
		w.send(events)
	}
}

// Close ends every watch; later Watch calls fail with ErrClosed.
func (h *WatchHub) Close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	for w := range h.ws {
		w.q.Stop()
	}
	h.ws = nil
}

// watcher is one Watch: the events under its prefix, queued.
type watcher struct {
	prefix string
	q      *Queue[Event]
}

func (w *watcher) send(events []Event) {
	w.q.push(func(queue []Event) []Event {
		start := len(queue)
		for _, e := range events {
			if strings.HasPrefix(e.Object.Key, w.prefix) {
				e.Last = false
				queue = append(queue, e)
			}
		}
		// Mark the last event of each commit this watcher gets.
		mine := queue[start:]
		for i := range mine {
			mine[i].Last = i == len(mine)-1 || mine[i+1].Rev != mine[i].Rev
		}
		return queue
	})
}
