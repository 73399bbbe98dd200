// Package etcdtest runs a real, single-member etcd on loopback for tests:
// the etcdindex tests and the end-to-end cluster tests share it. It uses
// Debian's etcd-server binary and skips the test when it is missing.
package etcdtest

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Bin is where Debian's etcd-server installs etcd.
const Bin = "/usr/bin/etcd"

// Server is one etcd process with its own data directory.
type Server struct {
	// ClientURL is the endpoint clients dial.
	ClientURL string
	t         testing.TB
	dir       string
	peerURL   string
	cmd       *exec.Cmd
	exited    chan struct{}
	log       syncBuffer
	stopped   bool
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// freePort returns a loopback port that nothing listens on, below the
// kernel's range of ephemeral ports. A port of that range that is free
// now may become the local end of a connection (the cluster tests make
// many) before etcd binds it, and etcd then fails to start
// (EADDRINUSE); below it only listeners take ports. Ports handed out in
// this process are not handed out again.
func freePort(t testing.TB) int {
	t.Helper()
	portMu.Lock()
	defer portMu.Unlock()
	lo := 32768 // the kernel's default
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil {
				lo = n
			}
		}
	}
	const base = 10000
	if lo < base+1000 {
		t.Fatalf("ephemeral ports start at %d: no room below them for etcd's ports", lo)
	}
	for range 1000 {
		p := base + rand.IntN(lo-base)
		if portsGiven[p] {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			continue
		}
		l.Close()
		portsGiven[p] = true
		return p
	}
	t.Fatalf("no free loopback port in [%d, %d)", base, lo)
	return 0
}

var (
	portMu     sync.Mutex
	portsGiven = map[int]bool{}
)

// Start starts etcd with a fresh data dir and stops it at cleanup (its log
// is printed if the test failed).
func Start(t testing.TB) *Server {
	t.Helper()
	if _, err := os.Stat(Bin); err != nil {
		t.Skipf("no etcd at %s (apt-get install etcd-server): %v", Bin, err)
	}
	s := &Server{
		t:         t,
		dir:       t.TempDir(),
		ClientURL: fmt.Sprintf("http://127.0.0.1:%d", freePort(t)),
		peerURL:   fmt.Sprintf("http://127.0.0.1:%d", freePort(t)),
	}
	s.Start()
	t.Cleanup(func() {
		s.Stop()
		if t.Failed() {
			t.Logf("etcd log:\n%s", s.log.String())
		}
	})
	return s
}

// Start (re)starts the process on the same data dir and ports and waits
// until it is healthy.
func (s *Server) Start() {
	t := s.t
	t.Helper()
	s.cmd = exec.Command(Bin,
		"--name", "test",
		"--data-dir", s.dir,
		"--listen-client-urls", s.ClientURL,
		"--advertise-client-urls", s.ClientURL,
		"--listen-peer-urls", s.peerURL,
		"--initial-advertise-peer-urls", s.peerURL,
		"--initial-cluster", "test="+s.peerURL,
		"--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn")
	s.cmd.Stdout, s.cmd.Stderr = &s.log, &s.log
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start etcd: %v", err)
	}
	s.exited = make(chan struct{})
	s.stopped = false
	go func() { s.cmd.Wait(); close(s.exited) }()
	// Bounded poll for the health endpoint; a dead process fails at once.
	hc := &http.Client{Timeout: time.Second}
	for deadline := time.Now().Add(30 * time.Second); ; {
		select {
		case <-s.exited:
			t.Fatalf("etcd exited at start:\n%s", s.log.String())
		default:
		}
		if resp, err := hc.Get(s.ClientURL + "/health"); err == nil {
			ok := resp.StatusCode == http.StatusOK
			resp.Body.Close()
			if ok {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("etcd not healthy at %s after 30s:\n%s", s.ClientURL, s.log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Stop stops the process (SIGTERM, then SIGKILL after 20s); the data dir
// stays for Start.
func (s *Server) Stop() {
	if s.stopped || s.cmd == nil {
		return
	}
	s.stopped = true
	s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
	case <-time.After(20 * time.Second):
		s.cmd.Process.Kill()
		<-s.exited
	}
}

// Log returns what etcd wrote so far.
func (s *Server) Log() string { return s.log.String() }

// Pause stops the process in place (SIGSTOP): requests hang instead of
// failing, like a stalled disk or network. Resume continues it.
//
// kill(2) returns once the signal is queued; the process stops only when
// one of its threads takes the signal and the others follow, and until
// then the threads that run go on answering requests (on a loaded
// machine for milliseconds). Pause returns once every thread is stopped.
func (s *Server) Pause() {
	if s.stopped || s.cmd == nil {
		return
	}
	s.t.Helper()
	if err := s.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		s.t.Fatalf("pause etcd: %v", err)
	}
	task := fmt.Sprintf("/proc/%d/task", s.cmd.Process.Pid)
	for deadline := time.Now().Add(30 * time.Second); ; {
		running, err := runningThreads(task)
		if err != nil {
			s.t.Fatalf("pause etcd: %v", err)
		}
		if running == "" {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("pause etcd: threads %s not stopped after 30s", running)
		}
		time.Sleep(time.Millisecond)
	}
}

// runningThreads names the threads under task (/proc/PID/task) that are
// neither stopped (state T) nor exiting (Z, X).
func runningThreads(task string) (string, error) {
	ents, err := os.ReadDir(task)
	if err != nil {
		return "", err
	}
	var running []string
	for _, e := range ents {
		b, err := os.ReadFile(task + "/" + e.Name() + "/stat")
		if err != nil {
			continue // the thread exited
		}
		i := bytes.LastIndexByte(b, ')')
		if i < 0 || i+2 >= len(b) {
			return "", fmt.Errorf("%s/%s/stat: %q", task, e.Name(), b)
		}
		if st := b[i+2]; st != 'T' && st != 'Z' && st != 'X' {
			running = append(running, fmt.Sprintf("%s(%c)", e.Name(), st))
		}
	}
	return strings.Join(running, " "), nil
}

// Resume continues a paused process (SIGCONT); a no-op otherwise.
func (s *Server) Resume() {
	if !s.stopped && s.cmd != nil {
		s.cmd.Process.Signal(syscall.SIGCONT)
	}
}
