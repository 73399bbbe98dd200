package store

import (
	"context"
	"sync"
)

// Queue is an unbounded queue drained into a channel by its own goroutine
// (Run): a producer never blocks on a slow consumer. WatchHub's watches
// and etcdindex's membership watches are Queues.
type Queue[T any] struct {
	out  chan T
	wake chan struct{}
	done chan struct{}
	once sync.Once
	mu   struct {
		sync.Mutex
		items []T
	}
}

// NewQueue returns an empty queue; start Run to drain it.
func NewQueue[T any]() *Queue[T] {
	return &Queue[T]{out: make(chan T), wake: make(chan struct{}, 1), done: make(chan struct{})}
}

// Out is the channel Run delivers to; it is closed when Run returns.
func (q *Queue[T]) Out() <-chan T { return q.out }

// Done is closed by Stop.
func (q *Queue[T]) Done() <-chan struct{} { return q.done }

// Send appends items, in order.
func (q *Queue[T]) Send(items ...T) { q.push(func(s []T) []T { return append(s, items...) }) }

// push changes the pending items under the queue's lock (filters and
// marks, for WatchHub) and wakes Run.
func (q *Queue[T]) push(fn func([]T) []T) {
	q.mu.Lock()
	q.mu.items = fn(q.mu.items)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// Stop ends Run; items not delivered yet are dropped. Stopping twice is a
// no-op.
func (q *Queue[T]) Stop() { q.once.Do(func() { close(q.done) }) }

// Run delivers items to Out until Stop or ctx ends, then closes Out.
func (q *Queue[T]) Run(ctx context.Context) {
	defer close(q.out)
	for {
		q.mu.Lock()
		items := q.mu.items
		q.mu.items = nil
		q.mu.Unlock()
		for _, it := range items {
			select {
			case q.out <- it:
			case <-q.done:
				return
			}
		}
		select {
		case <-q.wake:
		case <-q.done:
			return
		case <-ctx.Done():
			return
		}
	}
}
