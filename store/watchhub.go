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
	w := &watcher{prefix: prefix, out: make(chan Event), wake: make(chan struct{}, 1), done: make(chan struct{})}
	h.ws[w] = struct{}{}
	go func() {
		select {
		case <-ctx.Done():
		case <-w.done:
		}
		h.mu.Lock()
		delete(h.ws, w)
		h.mu.Unlock()
		w.stop()
	}()
	go w.run(ctx)
	return w.out, nil
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
		w.stop()
	}
	h.ws = nil
}

type watcher struct {
	prefix string
	out    chan Event
	wake   chan struct{}
	done   chan struct{}
	once   sync.Once
	mu     struct {
		sync.Mutex
		queue []Event
	}
}

func (w *watcher) send(events []Event) {
	w.mu.Lock()
	start := len(w.mu.queue)
	for _, e := range events {
		if strings.HasPrefix(e.Object.Key, w.prefix) {
			e.Last = false
			w.mu.queue = append(w.mu.queue, e)
		}
	}
	// Mark the last event of each commit this watcher gets.
	q := w.mu.queue[start:]
	for i := range q {
		q[i].Last = i == len(q)-1 || q[i+1].Rev != q[i].Rev
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
