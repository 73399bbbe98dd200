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

	tmpfsMounted bool
	daemon       *exec.Cmd
	daemonLog    *os.File
	daemonReady  chan struct{} // closed when the daemon has said READY
	daemonDone   chan struct{} // closed when the daemon has exited
	daemonErr    error         // its exit status, once daemonDone is closed
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
	var err error
	if e.daemonLog, err = os.Create(filepath.Join(e.dir, "daemon.log")); err != nil {
		return err
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return err
	}
	// --evict off: a case that outgrows the store fails with ENOSPC
	// instead of quietly measuring eviction.
	cmd := exec.Command(e.self, "mount", "--size", strconv.FormatUint(storeSize, 10), "--evict", "off", e.mnt)
	cmd.Stdout, cmd.Stderr = pw, e.daemonLog
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	err = cmd.Start()
	pw.Close()
	if err != nil {
		pr.Close()
		return fmt.Errorf("start daemon: %w", err)
	}
	e.daemon, e.daemonDone = cmd, make(chan struct{})
	go func() {
		e.daemonErr = cmd.Wait()
		close(e.daemonDone)
	}()

	// The goroutine owns pr, and drains it until the daemon exits so
	// that the daemon never blocks on (or dies of) a write to stdout.
	ready := make(chan struct{})
	e.daemonReady = ready
	go func() {
		defer pr.Close()
		rd := bufio.NewReader(pr)
		want := "READY " + e.mnt
		for {
			line, err := rd.ReadString('\n')
			if strings.TrimSpace(line) == want {
				close(ready)
				break
			}
			if err != nil {
				return
			}
		}
		_, _ = io.Copy(io.Discard, rd)
	}()
	t := time.NewTimer(benchReadyTimeout)
	defer t.Stop()
	select {
	case <-ready:
		return nil
	case <-e.daemonDone:
		return fmt.Errorf("daemon exited before READY: %v", e.daemonErr)
	case <-t.C:
		return fmt.Errorf("daemon not READY after %v", benchReadyTimeout)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// close stops the daemon, unmounts both file systems and removes the
// temporary directories. It only removes empty directories, so nothing
// on a mount that failed to come off is touched.
func (e *benchEnv) close() error {
	var errs []error
	if e.daemon != nil {
		if err := e.stopDaemon(); err != nil {
			errs = append(errs, err)
		}
	}
	if e.failed && e.daemonLog != nil {
		dumpTail(os.Stderr, e.daemonLog.Name(), 8<<10)
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
	if e.daemonLog != nil {
		e.daemonLog.Close()
		os.Remove(e.daemonLog.Name())
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

// stopDaemon sends SIGTERM, which unmounts and gives back the daemon's
// hugepages, and waits; SIGKILL only if it does not stop in time.
func (e *benchEnv) stopDaemon() error {
	select {
	case <-e.daemonDone:
		return nil
	default:
	}
	// A daemon still starting up may die of SIGTERM before it handles
	// it, leaving its mount and reserved hugepages behind: let it finish.
	t := time.NewTimer(benchReadyTimeout)
	select {
	case <-e.daemonReady:
	case <-e.daemonDone:
		t.Stop()
		return nil
	case <-t.C:
	}
	t.Stop()
	_ = e.daemon.Process.Signal(syscall.SIGTERM)
	t = time.NewTimer(benchStopTimeout)
	defer t.Stop()
	select {
	case <-e.daemonDone:
		return nil
	case <-t.C:
	}
	_ = e.daemon.Process.Kill()
	<-e.daemonDone
	return fmt.Errorf("daemon did not stop within %v of SIGTERM; killed (hugepages it reserved may still be in nr_hugepages)", benchStopTimeout)
}

func (e *benchEnv) daemonExited() bool {
	if e.daemonDone == nil {
		return false
	}
	select {
	case <-e.daemonDone:
		return true
	default:
		return false
	}
}

// worker runs one phase of a case in a fresh "bench worker" process and
// returns its sample. With sampleDaemon it also measures the daemon's CPU
// use while the worker ran.
func (e *benchEnv) worker(ctx context.Context, phase, name, dir string, p benchParams, sampleDaemon bool) (sideRun, error) {
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
	if sampleDaemon {
		cpu0, _ = procCPU(e.daemon.Process.Pid)
	}
	t0 := time.Now()
	err = cmd.Run()
	wall := time.Since(t0)
	var sr sideRun
	if sampleDaemon && err == nil {
		if cpu1, cerr := procCPU(e.daemon.Process.Pid); cerr == nil {
			sr.daemonCPU = (cpu1 - cpu0).Seconds() / wall.Seconds()
		}
	}
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		switch {
		case ctx.Err() != nil:
			return sr, ctx.Err()
		case wctx.Err() != nil:
			msg = fmt.Sprintf("timed out after %v; %s", benchWorkerTimeout, msg)
		case e.daemonExited():
			msg = fmt.Sprintf("daemon exited (%v); %s", e.daemonErr, msg)
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
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name, which may hold spaces: state is
	// field 3, utime 14, stime 15.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	ut, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, err
	}
	// USER_HZ is 100 on every Linux ABI Go supports.
	return time.Duration(ut+st) * (time.Second / 100), nil
}

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
