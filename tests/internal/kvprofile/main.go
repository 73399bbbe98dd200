// Command kvprofile profiles a running daemon while it takes batch puts
// of GPU blocks, as the bench's kv-put-gpu cases send them: 64 keys a
// call from one registered CUDA allocation of 256 MiB, new keys into a
// fresh directory per pass, in phases of a number of calls in flight.
// Unlike the bench, whose daemon spends most of a repetition setting up
// and checking, the daemon here does nothing else, so a CPU profile and a
// runtime trace taken during a phase (from the daemon's --metrics
// address) show the puts alone. The store must be large enough for the
// phases' keys (none is removed but with -keep): a phase stops at the
// first key that finds no room.
//
//	kvprofile [-block 16384] [-keep N] -metrics ADDR -out DIR MOUNTDIR PHASE...
//
// A PHASE is IN_FLIGHT:SECONDS (e.g. 1:2 4:1.5). For each, OUT gets
// cpu-N-ifK.prof and trace-N-ifK.bin, and stdout a line with the keys
// put, the time per key and the daemon's page faults per key (minor
// faults: first touches of memory, its heap's included). With -keep N,
// a pass's directory is removed once N later passes are done (untimed),
// so the index and the daemon's heap stop growing, as in the bench,
// whose repetitions remove their keys; by default every key stays.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// passBytes is what one pass puts: the kv-put-gpu cases' 256 MiB.
const passBytes = 256 << 20

type phase struct {
	inFlight int
	dur      time.Duration
}

func parsePhase(s string) (phase, error) {
	a, b, ok := strings.Cut(s, ":")
	n, err1 := strconv.Atoi(a)
	secs, err2 := strconv.ParseFloat(b, 64)
	if !ok || err1 != nil || err2 != nil || n < 1 || secs <= 0 {
		return phase{}, fmt.Errorf("phase %q: want IN_FLIGHT:SECONDS", s)
	}
	return phase{n, time.Duration(secs * float64(time.Second))}, nil
}

// fetch saves what url answers to path.
func fetch(url, path string) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func main() {
	block := flag.Uint64("block", 16<<10, "bytes a key")
	metrics := flag.String("metrics", "", "the daemon's --metrics address")
	out := flag.String("out", ".", "directory for the profiles")
	keep := flag.Int("keep", 0, "remove each pass's keys once this many later passes are done (0: keep all)")
	flag.Parse()
	if flag.NArg() < 2 || *metrics == "" || *block == 0 || passBytes%*block != 0 || *keep < 0 {
		fmt.Fprintln(os.Stderr, "usage: kvprofile [-block N] [-keep N] -metrics ADDR -out DIR MOUNTDIR PHASE...")
		os.Exit(2)
	}
	var phases []phase
	for _, s := range flag.Args()[1:] {
		p, err := parsePhase(s)
		if err != nil {
			fmt.Fprintln(os.Stderr, "kvprofile:", err)
			os.Exit(2)
		}
		phases = append(phases, p)
	}
	if err := run(flag.Arg(0), *block, *keep, *metrics, *out, phases); err != nil {
		fmt.Fprintln(os.Stderr, "kvprofile:", err)
		os.Exit(1)
	}
}

func run(dir string, block uint64, keep int, metrics, out string, phases []phase) error {
	if err := cuda.Init(); err != nil {
		return err
	}
	ctx, err := cuda.Retain(0)
	if err != nil {
		return err
	}
	defer ctx.Release()
	dev, err := ctx.MemAlloc(passBytes)
	if err != nil {
		return err
	}
	defer ctx.MemFree(dev)
	h, err := ctx.IpcGetHandle(dev)
	if err != nil {
		return err
	}
	keys := int(passBytes / block)
	items := make([]ioctl.BatchItem, keys)
	for k := range items {
		items[k] = ioctl.BatchItem{Key: fmt.Sprintf("k%06d", k), BufOff: uint64(k) * block, Len: block}
	}
	ioctl.BatchCallKeys = ioctl.MaxBatch // as the bench's GPU cases
	if _, err := daemonFaults(dir); err != nil {
		return err
	}
	pass := 0
	for i, ph := range phases {
		ioctl.BatchInFlight = ph.inFlight
		var wg sync.WaitGroup
		var profErr error
		wg.Go(func() {
			// Inside the phase: after its first calls, ending before it.
			time.Sleep(ph.dur / 5)
			secs := max(1, int((ph.dur*3/5)/time.Second))
			name := fmt.Sprintf("%d-if%d", i, ph.inFlight)
			if err := fetch(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", metrics, secs), filepath.Join(out, "cpu-"+name+".prof")); err != nil {
				profErr = err
				return
			}
			profErr = fetch(fmt.Sprintf("http://%s/debug/pprof/trace?seconds=0.3", metrics), filepath.Join(out, "trace-"+name+".bin"))
		})
		n, busy, faults, err := putFor(dir, h, items, ph.dur, &pass, keep)
		wg.Wait()
		if n > 0 {
			fmt.Printf("phase %d, %d in flight: %d keys of %d B, %.3f us a key, %.3f daemon page faults a key\n",
				i, ph.inFlight, n, block, float64(busy.Nanoseconds())/float64(n)/1e3, float64(faults)/float64(n))
		}
		if err != nil {
			return err
		}
		if profErr != nil {
			return profErr
		}
	}
	return nil
}

// putFor puts items into fresh directories of dir, one pass after the
// other, for about d; it returns the keys put, the time their calls took
// and the daemon's minor page faults during them (its status's). With
// keep > 0 it removes the directory of the pass keep passes back after
// each pass, outside the time and the faults counted. A key that finds
// no room ends it (nil error: the store is full).
func putFor(dir string, h [cuda.IpcHandleSize]byte, items []ioctl.BatchItem, d time.Duration, pass *int, keep int) (int, time.Duration, int64, error) {
	end := time.Now().Add(d)
	n, busy, faults := 0, time.Duration(0), int64(0)
	passDir := func(p int) string { return filepath.Join(dir, fmt.Sprintf("pass%d", p)) }
	for time.Now().Before(end) {
		sub := passDir(*pass)
		*pass++
		if err := os.Mkdir(sub, 0o755); err != nil {
			return n, busy, faults, err
		}
		f, err := ioctl.OpenDir(sub)
		if err != nil {
			return n, busy, faults, err
		}
		reg, err := f.RegisterCUDA(h, 0, passBytes)
		if err != nil {
			f.Close()
			return n, busy, faults, err
		}
		f0, err := daemonFaults(dir)
		if err != nil {
			f.Close()
			return n, busy, faults, err
		}
		t0 := time.Now()
		res, err := f.BatchPutBuf(reg.ID, items)
		busy += time.Since(t0)
		f1, ferr := daemonFaults(dir)
		faults += f1 - f0
		f.Close()
		if err == nil {
			err = ferr
		}
		if err != nil {
			return n, busy, faults, err
		}
		for _, r := range res {
			if r.Err != nil {
				fmt.Println("stopped:", r.Err)
				return n, busy, faults, nil
			}
			n++
		}
		if old := *pass - 1 - keep; keep > 0 && old >= 0 {
			if err := os.RemoveAll(passDir(old)); err != nil {
				return n, busy, faults, err
			}
		}
	}
	return n, busy, faults, nil
}

// daemonFaults is the minor page faults so far of the daemon serving
// mount dir (its status's batch figures).
func daemonFaults(dir string) (int64, error) {
	b, err := ioctl.ReadStatus(dir)
	if err != nil {
		return 0, err
	}
	var st struct {
		Batches struct {
			MinorFaults *int64 `json:"minor_faults"`
		} `json:"batches"`
	}
	if err := json.Unmarshal(b, &st); err != nil || st.Batches.MinorFaults == nil {
		return 0, fmt.Errorf("status of %s: no batches.minor_faults (%v)", dir, err)
	}
	return *st.Batches.MinorFaults, nil
}
