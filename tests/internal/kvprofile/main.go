// Command kvprofile profiles a running daemon while it takes batch puts
// of GPU blocks, as the bench's kv-put-gpu cases send them: 64 keys a
// call from one registered CUDA allocation of 256 MiB, new keys into a
// fresh directory per pass, in phases of a number of calls in flight.
// With -host it puts from a registered memfd instead, as the
// kv-put-host cases do (table calls of up to ioctl.BatchCallKeys keys),
// registered once, into MOUNTDIR itself under names led by the pass's
// number; -pass sets the bytes of a pass (as few keys a pass as a
// bench repetition's keep the daemon's index small, as there). A pass
// goes as one client batch, as the bench sends it; -batch N cuts it into
// client calls of N keys, one after the other. A client call of 64 keys
// or fewer is one call to the daemon, so with such an N a phase's calls
// in flight never overlap.
// Unlike the bench, whose daemon spends most of a repetition setting up
// and checking, the daemon here does nothing else, so a CPU profile and a
// runtime trace taken during a phase (from the daemon's --metrics
// address) show the puts alone. The store must be large enough for the
// phases' keys (none is removed but with -keep): a phase stops at the
// first key that finds no room.
//
//	kvprofile [-host] [-block 16384] [-pass BYTES] [-batch KEYS] [-keep N] [-perf-ctl CTL,ACK] -metrics ADDR -out DIR MOUNTDIR PHASE...
//
// A PHASE is IN_FLIGHT:SECONDS (e.g. 1:2 4:1.5). For each, OUT gets
// cpu-N-ifK.prof and trace-N-ifK.bin, and stdout a line with the keys
// put, the time per key and the daemon's page faults per key (minor
// faults: first touches of memory, its heap's included). With -keep N,
// a pass's directory is removed once N later passes are done (untimed),
// so the index and the daemon's heap stop growing, as in the bench,
// whose repetitions remove their keys; by default every key stays.
//
// With -host -get, the passes get instead: one pass's keys, put once
// before the first, untimed, read back into the registration by every
// pass, as the kv-get-host cases do.
//
// With -perf-ctl CTL,ACK (the FIFOs of `perf record --control
// fifo:CTL,ACK -D -1`), perf records only while the timed calls run: a
// system-wide profile then holds the puts' CPU time alone, the client's
// and the kernel's included, without the passes' removals between them.
package main

import (
	"bufio"
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

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// passBytes is what one pass puts: by default the kv-put-gpu cases'
// 256 MiB.
var passBytes uint64 = 256 << 20

// getMode (-get): the passes get one pass's keys, put once, untimed.
var getMode bool

// batchKeys is the most keys one client call puts: by default a whole
// pass (the bench's host cases call with 1024).
var batchKeys = 1 << 30

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
	host := flag.Bool("host", false, "put from a registered memfd instead of GPU memory")
	perfCtl := flag.String("perf-ctl", "", "CTL,ACK: perf record's control FIFOs, to record the timed calls alone")
	flag.BoolVar(&getMode, "get", false, "with -host: put one pass's keys once, untimed, then time gets of them into the registration")
	flag.Uint64Var(&passBytes, "pass", passBytes, "bytes a pass")
	flag.IntVar(&batchKeys, "batch", batchKeys, "keys a client call (BatchPutBuf) puts; a pass is as many calls as it takes")
	flag.Parse()
	if flag.NArg() < 2 || *metrics == "" || *block == 0 || passBytes == 0 || passBytes%*block != 0 || *keep < 0 || batchKeys < 1 || getMode && !*host {
		fmt.Fprintln(os.Stderr, "usage: kvprofile [-host [-get]] [-block N] [-pass BYTES] [-batch KEYS] [-keep N] [-perf-ctl CTL,ACK] -metrics ADDR -out DIR MOUNTDIR PHASE...")
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
	if *perfCtl != "" {
		var err error
		if perf, err = openPerf(*perfCtl); err != nil {
			fmt.Fprintln(os.Stderr, "kvprofile:", err)
			os.Exit(2)
		}
	}
	src := gpuSource
	if *host {
		src = hostSource
	}
	if err := run(flag.Arg(0), src, *block, *keep, *metrics, *out, phases); err != nil {
		fmt.Fprintln(os.Stderr, "kvprofile:", err)
		os.Exit(1)
	}
}

// A pinnedSource is the memory passes put from. register registers it
// on a directory; with f set (host memory), one registration reg on the
// mount's root, made once, serves every pass; done releases it all.
type pinnedSource struct {
	register func(f *ioctl.File) (ioctl.Registration, error)
	f        *ioctl.File
	reg      ioctl.Registration
	done     func()
}

// gpuSource is one CUDA allocation of passBytes, registered by IPC
// handle on each pass's directory.
func gpuSource(string) (*pinnedSource, error) {
	if err := cuda.Init(); err != nil {
		return nil, err
	}
	ctx, err := cuda.Retain(0)
	if err != nil {
		return nil, err
	}
	dev, err := ctx.MemAlloc(passBytes)
	if err != nil {
		ctx.Release()
		return nil, err
	}
	done := func() { ctx.MemFree(dev); ctx.Release() }
	h, err := ctx.IpcGetHandle(dev)
	if err != nil {
		done()
		return nil, err
	}
	ioctl.BatchCallKeys = ioctl.MaxBatch // as the bench's GPU cases
	return &pinnedSource{register: func(f *ioctl.File) (ioctl.Registration, error) { return f.RegisterCUDA(h, 0, passBytes) }, done: done}, nil
}

// hostSource is a memfd of passBytes, filled, and registered once on
// directory dir.
func hostSource(dir string) (*pinnedSource, error) {
	fd, err := unix.MemfdCreate("kvprofile", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	m := os.NewFile(uintptr(fd), "kvprofile")
	if err := m.Truncate(int64(passBytes)); err != nil {
		m.Close()
		return nil, err
	}
	mem, err := unix.Mmap(fd, 0, int(passBytes), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		m.Close()
		return nil, err
	}
	for i := range mem {
		mem[i] = byte(i * 7)
	}
	s := &pinnedSource{done: func() { unix.Munmap(mem); m.Close() }}
	if s.f, err = ioctl.OpenDir(dir); err != nil {
		s.done()
		return nil, err
	}
	if s.reg, err = s.f.Register(m, 0, passBytes); err != nil {
		s.f.Close()
		s.done()
		return nil, err
	}
	done := s.done
	s.done = func() { s.f.Close(); done() }
	return s, nil
}

func run(dir string, source func(string) (*pinnedSource, error), block uint64, keep int, metrics, out string, phases []phase) error {
	src, err := source(dir)
	if err != nil {
		return err
	}
	defer src.done()
	keys := int(passBytes / block)
	items := make([]ioctl.BatchItem, keys)
	for k := range items {
		items[k] = ioctl.BatchItem{Key: fmt.Sprintf("k%06d", k), BufOff: uint64(k) * block, Len: block}
	}
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
		n, busy, faults, err := putFor(dir, src, items, ph.dur, &pass, keep)
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

// putFor puts items for about d, one pass after the other; it returns
// the keys put, the time their calls took and the daemon's minor page
// faults during them (its status's). A pass on GPU memory puts into a
// fresh directory of dir, registering the allocation on it, as the
// bench's repetitions do. A pass on host memory puts into dir itself,
// from one registration kept for the whole run (as an engine's pool is),
// its keys' names led by the pass's number. With keep > 0 it removes the
// keys of the pass keep passes back after each pass, outside the time
// and the faults counted. A key that finds no room ends it (nil error:
// the store is full).
func putFor(dir string, src *pinnedSource, items []ioctl.BatchItem, d time.Duration, pass *int, keep int) (int, time.Duration, int64, error) {
	end := time.Now().Add(d)
	n, busy, faults := 0, time.Duration(0), int64(0)
	passDir := func(p int) string { return filepath.Join(dir, fmt.Sprintf("pass%d", p)) }
	prefix := func(p int) string { return fmt.Sprintf("p%d-", p) }
	named := make([]ioctl.BatchItem, len(items))
	for time.Now().Before(end) {
		p := *pass
		*pass++
		f, reg := src.f, src.reg
		if f == nil {
			if err := os.Mkdir(passDir(p), 0o755); err != nil {
				return n, busy, faults, err
			}
			var err error
			if f, err = ioctl.OpenDir(passDir(p)); err != nil {
				return n, busy, faults, err
			}
			if reg, err = src.register(f); err != nil {
				f.Close()
				return n, busy, faults, err
			}
			copy(named, items)
		} else if !getMode || named[0].Key == "" {
			q := p
			if getMode {
				q = 0 // the keys pass 0 put
			}
			for k, it := range items {
				it.Key = prefix(q) + it.Key
				named[k] = it
			}
		}
		if getMode && p == 0 {
			// The keys the gets read, put once, untimed.
			res, err := f.BatchPutBuf(reg.ID, named)
			for _, r := range res {
				if err == nil {
					err = r.Err
				}
			}
			if err != nil {
				return n, busy, faults, err
			}
		}
		closeF := func() {
			if f != src.f {
				f.Close()
			}
		}
		f0, err := daemonFaults(dir)
		if err != nil {
			closeF()
			return n, busy, faults, err
		}
		if err := perf.command("enable"); err != nil {
			closeF()
			return n, busy, faults, err
		}
		t0 := time.Now()
		var res []ioctl.BatchResult
		for i := 0; i < len(named) && err == nil; i += batchKeys {
			var r []ioctl.BatchResult
			if getMode {
				r, err = f.BatchGetBuf(reg.ID, named[i:min(i+batchKeys, len(named))])
			} else {
				r, err = f.BatchPutBuf(reg.ID, named[i:min(i+batchKeys, len(named))])
			}
			res = append(res, r...)
		}
		busy += time.Since(t0)
		if perr := perf.command("disable"); err == nil {
			err = perr
		}
		f1, ferr := daemonFaults(dir)
		faults += f1 - f0
		closeF()
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
		if old := p - keep; keep > 0 && old >= 0 && !getMode {
			if src.f == nil {
				err = os.RemoveAll(passDir(old))
			} else {
				for _, it := range items {
					if err = os.Remove(filepath.Join(dir, prefix(old)+it.Key)); err != nil {
						break
					}
				}
			}
			if err != nil {
				return n, busy, faults, err
			}
		}
	}
	return n, busy, faults, nil
}

// perfControl is perf record's control FIFOs (nil: none).
type perfControl struct {
	ctl *os.File
	ack *bufio.Reader
}

var perf *perfControl

// openPerf opens "CTL,ACK". perf opens them as it starts, so this
// waits for perf.
func openPerf(spec string) (*perfControl, error) {
	ctlPath, ackPath, ok := strings.Cut(spec, ",")
	if !ok {
		return nil, fmt.Errorf("-perf-ctl %q: want CTL,ACK", spec)
	}
	ctl, err := os.OpenFile(ctlPath, os.O_WRONLY, 0)
	if err != nil {
		return nil, err
	}
	ack, err := os.Open(ackPath)
	if err != nil {
		ctl.Close()
		return nil, err
	}
	return &perfControl{ctl: ctl, ack: bufio.NewReader(ack)}, nil
}

// command sends cmd and waits for perf's ack.
func (p *perfControl) command(cmd string) error {
	if p == nil {
		return nil
	}
	if _, err := p.ctl.WriteString(cmd + "\n"); err != nil {
		return fmt.Errorf("perf %s: %w", cmd, err)
	}
	if line, err := p.ack.ReadString('\n'); err != nil || strings.Trim(line, "\x00") != "ack\n" { // perf may lead it with a NUL
		return fmt.Errorf("perf %s: answered %q (%v)", cmd, line, err)
	}
	return nil
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
