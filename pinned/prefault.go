package pinned

import (
	"sync"
	"time"
)

// prefault writes a zero byte to every page of mem so that later writes do
// not fault, splitting mem into at most workers contiguous runs of whole
// pages, one goroutine each. len(mem) is a multiple of pageSize.
func prefault(mem []byte, pageSize uint64, workers int) time.Duration {
	start := time.Now()
	ps := int(pageSize)
	pages := len(mem) / ps
	workers = min(max(workers, 1), pages)
	if workers == 0 {
		return 0
	}
	per, extra := pages/workers, pages%workers
	var wg sync.WaitGroup
	first := 0
	for w := range workers {
		n := per
		if w < extra {
			n++
		}
		run := mem[first*ps : (first+n)*ps]
		first += n
		wg.Go(func() {
			for i := 0; i < len(run); i += ps {
				run[i] = 0
			}
		})
	}
	wg.Wait()
	return time.Since(start)
}
