package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

const (
	benchReadyTimeout  = 60 * time.Second
	benchStopTimeout   = 30 * time.Second // the daemon itself waits up to 10 s for busy files
	benchWorkerTimeout = 10 * time.Minute
)

// benchEnv is the benchmark's private mount and ceiling: a temporary
// directory holding mnt (a mooncake-fs daemon run as a child) and tmpfs.
// close undoes whatever start got done, on every path.
type benchEnv struct {
	self   string // this binary
	dir    string
	mnt    string
	tmpfs  string
	failed bool // dump the daemon's log at close
	// daemonCPUs and daemonMetrics, when set, are its --cpus and --metrics.
	daemonCPUs    string
	daemonMetrics string
	// clusterNodeSize is the capacity of each cluster daemon.
	clusterNodeSize uint64

	tmpfsMounted bool
	daemon       *benchProc
	clusters     map[string]*benchCluster // by RDMA kind, started by their first case
}

// benchProc is a child process the benchmark runs and stops: a daemon or
// etcd.
type benchProc struct {
	name  string
	cmd   *exec.Cmd
	log   *os.File
	ready chan struct{} // closed when it has said its ready line
	done  chan struct{} // closed when it has exited
	err   error         // its exit status, once done is closed
}

func (e *benchEnv) start(ctx context.Context, storeSize, tmpfsSize uint64) error {
	dir, err := os.MkdirTemp("", "mooncake-bench-")
	if err != nil {
		return err
	}
	// Paths in /proc/self/mountinfo are resolved ones.
	if e.dir, err = filepath.EvalSymlinks(dir); err != nil {
		e.dir = dir
		return err
	}
	e.mnt, e.tmpfs = filepath.Join(e.dir, "mnt"), filepath.Join(e.dir, "tmpfs")
	for _, d := range []string{e.mnt, e.tmpfs} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return err
		}
	}
	opts := fmt.Sprintf("size=%d,mode=0755", tmpfsSize)
	if err := unix.Mount("tmpfs", e.tmpfs, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("mount tmpfs at %s: %w", e.tmpfs, err)
	}
	e.tmpfsMounted = true
	return e.startDaemon(ctx, storeSize)
}

// startDaemon runs "mooncake-fs mount" and waits for its READY line.
func (e *benchEnv) startDaemon(ctx context.Context, storeSize uint64) error {
	// --evict off: a case that outgrows the store fails with ENOSPC
	// instead of quietly measuring eviction.
	args := []string{"mount", "--size", strconv.FormatUint(storeSize, 10), "--evict", "off"}
	if e.daemonCPUs != "" {
		args = append(args, "--cpus", e.daemonCPUs)
	}
	if e.daemonMetrics != "" {
		args = append(args, "--metrics", e.daemonMetrics)
	}
	var err error
	e.daemon, err = e.startProc(ctx, "daemon", "READY "+e.mnt, e.self, append(args, e.mnt)...)
	return err
}

// startProc starts a child in its own process group (SIGTERM if bench
// dies), logging to a file in the bench directory, and waits for ready on
// its stdout ("" waits for nothing).
func (e *benchEnv) startProc(ctx context.Context, name, ready string, bin string, args ...string) (*benchProc, error) {
	p := &benchProc{name: name, ready: make(chan struct{}), done: make(chan struct{})}
	var err error
	if p.log, err = os.Create(filepath.Join(e.dir, name+".log")); err != nil {
		return nil, err
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = pw, p.log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	err = cmd.Start()
	pw.Close()
	if err != nil {
		pr.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p.cmd = cmd
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()

	// The goroutine owns pr, and drains it until the child exits so that
	// the child never blocks on (or dies of) a write to stdout.
	go func() {
		defer pr.Close()
		rd := bufio.NewReader(pr)
		for ready != "" {
			line, err := rd.ReadString('\n')
			if strings.TrimSpace(line) == ready {
				break
			}
			if err != nil {
				return
			}
		}
		close(p.ready)
		_, _ = io.Copy(io.Discard, rd)
	}()
	t := time.NewTimer(benchReadyTimeout)
	defer t.Stop()
	select {
	case <-p.ready:
		return p, nil
	case <-p.done:
		return p, fmt.Errorf("%s exited before it was ready: %v", name, p.err)
	case <-t.C:
		return p, fmt.Errorf("%s not ready after %v", name, benchReadyTimeout)
	case <-ctx.Done():
		return p, ctx.Err()
	}
}

// close stops the daemons, unmounts both file systems and removes the
// temporary directories. It only removes empty directories, so nothing
// on a mount that failed to come off is touched.
func (e *benchEnv) close() error {
	errs := []error{e.stopClusters()}
	if e.daemon != nil {
		if err := e.daemon.stop(); err != nil {
			errs = append(errs, err)
		}
		if e.failed {
			dumpTail(os.Stderr, e.daemon.log.Name(), 8<<10)
		}
		e.daemon.removeLog()
	}
	if e.mnt != "" {
		// A daemon that died or was killed leaves its mount behind.
		if m, _ := mountedAt(e.mnt); m {
			if err := unix.Unmount(e.mnt, unix.MNT_DETACH); err != nil {
				errs = append(errs, fmt.Errorf("detach %s: %w", e.mnt, err))
			}
		}
	}
	if e.tmpfsMounted {
		if err := unmountRetry(e.tmpfs); err != nil {
			errs = append(errs, err)
		} else {
			e.tmpfsMounted = false
		}
	}
	for _, d := range []string{e.mnt, e.tmpfs, e.dir} {
		if d == "" {
			continue
		}
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (p *benchProc) removeLog() {
	if p.log != nil {
		p.log.Close()
		os.Remove(p.log.Name())
	}
}

// stop sends SIGTERM, which makes a daemon unmount and give back its
// hugepages, and waits; SIGKILL only if it does not stop in time.
func (p *benchProc) stop() error {
	if p.cmd == nil {
		return nil
	}
	select {
	case <-p.done:
		return nil
	default:
	}
	// A daemon still starting up may die of SIGTERM before it handles
	// it, leaving its mount and reserved hugepages behind: let it finish.
	t := time.NewTimer(benchReadyTimeout)
	select {
	case <-p.ready:
	case <-p.done:
		t.Stop()
		return nil
	case <-t.C:
	}
	t.Stop()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	t = time.NewTimer(benchStopTimeout)
	defer t.Stop()
	select {
	case <-p.done:
		return nil
	case <-t.C:
	}
	_ = p.cmd.Process.Kill()
	<-p.done
	return fmt.Errorf("%s did not stop within %v of SIGTERM; killed (hugepages it reserved may still be in nr_hugepages)", p.name, benchStopTimeout)
}

func (p *benchProc) exited() bool {
	if p == nil || p.done == nil {
		return false
	}
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// worker runs one phase of a case in a fresh "bench worker" process and
// returns its sample. With a daemon to sample it also measures that
// daemon's CPU use while the worker ran.
func (e *benchEnv) worker(ctx context.Context, phase, name, dir string, p benchParams, daemon *benchProc) (sideRun, error) {
	raw, err := json.Marshal(p)
	if err != nil {
		return sideRun{}, err
	}
	wctx, cancel := context.WithTimeout(ctx, benchWorkerTimeout)
	defer cancel()
	cmd := exec.CommandContext(wctx, e.self, "bench", "worker", phase, name, dir, string(raw))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 5 * time.Second

	var cpu0 time.Duration
	if daemon != nil {
		cpu0, _ = procCPU(daemon.cmd.Process.Pid)
	}
	steal0, serr0 := hostSteal()
	t0 := time.Now()
	err = cmd.Run()
	wall := time.Since(t0)
	var sr sideRun
	if daemon != nil && err == nil {
		if cpu1, cerr := procCPU(daemon.cmd.Process.Pid); cerr == nil {
			sr.daemonCPU = (cpu1 - cpu0).Seconds() / wall.Seconds()
		}
	}
	if steal1, serr1 := hostSteal(); serr0 == nil && serr1 == nil && err == nil {
		sr.hostSteal = max(steal1-steal0, 0).Seconds() / wall.Seconds()
	}
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		switch {
		case ctx.Err() != nil:
			return sr, ctx.Err()
		case wctx.Err() != nil:
			msg = fmt.Sprintf("timed out after %v; %s", benchWorkerTimeout, msg)
		case daemon.exited():
			msg = fmt.Sprintf("daemon exited (%v); %s", daemon.err, msg)
		}
		return sr, fmt.Errorf("worker %s on %s: %w: %s", phase, sideName(dir), err, msg)
	}
	if phase != "run" && phase != "ceiling" {
		return sr, nil
	}
	out := bytes.TrimSpace(stdout.Bytes())
	if i := bytes.LastIndexByte(out, '\n'); i >= 0 {
		out = out[i+1:]
	}
	if err := json.Unmarshal(out, &sr.sample); err != nil {
		return sr, fmt.Errorf("worker %s on %s: bad result %q: %w", phase, sideName(dir), out, err)
	}
	if sr.sample.Ns <= 0 {
		return sr, fmt.Errorf("worker %s on %s: result %q has no duration", phase, sideName(dir), out)
	}
	return sr, nil
}

func sideName(dir string) string {
	if dir == "" {
		return "memory"
	}
	return dir
}

// procCPU returns the user plus system time of process pid, all threads.
func procCPU(pid int) (time.Duration, error) {
	f, err := procStat(pid)
	if err != nil {
		return 0, err
	}
	ut, err1 := strconv.ParseUint(string(f[11]), 10, 64)
	st, err2 := strconv.ParseUint(string(f[12]), 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, err
	}
	return time.Duration(ut+st) * clockTick, nil
}

// hostSteal is the time the hypervisor gave this machine's virtual CPUs
// to others since boot, all CPUs together (/proc/stat's steal; 0 on bare
// metal).
func hostSteal() (time.Duration, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	return parseSteal(b)
}

// parseSteal reads the steal field of /proc/stat's first line, "cpu"
// followed by user, nice, system, idle, iowait, irq, softirq and steal,
// in USER_HZ ticks.
func parseSteal(b []byte) (time.Duration, error) {
	line, _, _ := bytes.Cut(b, []byte{'\n'})
	f := strings.Fields(string(line))
	if len(f) < 9 || f[0] != "cpu" {
		return 0, fmt.Errorf("/proc/stat: first line %q has no steal field", line)
	}
	ticks, err := strconv.ParseUint(f[8], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("/proc/stat: steal: %w", err)
	}
	return time.Duration(ticks) * clockTick, nil
}

// clockTick is the unit of /proc's CPU times (USER_HZ: 100 on every
// Linux ABI Go supports).
const clockTick = time.Second / 100

// mountedAt reports whether dir is a mount point in this namespace.
func mountedAt(dir string) (bool, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == dir {
			return true, nil
		}
	}
	return false, nil
}

// unmountRetry unmounts dir, retrying while it is busy (a killed worker's
// files are closed asynchronously), and detaches it lazily at last.
func unmountRetry(dir string) error {
	var err error
	for range 20 {
		if err = unix.Unmount(dir, 0); err == nil || err == unix.EINVAL {
			return nil // EINVAL: not a mount point (any more)
		}
		if err != unix.EBUSY {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if lerr := unix.Unmount(dir, unix.MNT_DETACH); lerr != nil {
		return fmt.Errorf("unmount %s: %w (lazy: %v)", dir, err, lerr)
	}
	return nil
}

// dumpTail copies the last n bytes of file to w.
func dumpTail(w io.Writer, file string, n int64) {
	f, err := os.Open(file)
	if err != nil {
		return
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		_, _ = f.Seek(-n, io.SeekEnd)
	}
	fmt.Fprintf(w, "--- daemon log (%s) ---\n", file)
	_, _ = io.Copy(w, f)
	fmt.Fprintln(w, "--- end of daemon log ---")
}
