package main

// The cluster cases run on a two-node cluster the benchmark starts on
// loopback: an etcd (Debian's etcd-server; the cases are skipped without
// it) and daemons bench-a and bench-b. Workers use node A's mount.
//
//   - remote-put, remote-get: the 64 MiB value of ioctl-put-buf and
//     ioctl-get-buf, in a directory of A placed on B (placement
//     node:bench-b), so every byte crosses the TCP transport into or out
//     of B's segments. The ceiling is a plain TCP stream of the same
//     bytes between the worker and a second process on loopback, over as
//     many connections as the transport uses (4), measured right after in
//     the same worker.
//   - remote-put-rdma, remote-get-rdma: the same over the machine's RDMA
//     devices (a cluster of nodes rdma-a and rdma-b, --rdma auto; the
//     TCP cases' nodes run --rdma off), with the TCP stream as the
//     ceiling, so the ratio is RDMA's gain over it; skipped where no
//     device is usable, with the reason. They also report copies_per_byte.
//   - remote-{put,get}-rdma-fake and remote-{put,get}-vm-rdma-fake: on the
//     software NIC of the tests (--rdma-fake), registered buffers and
//     process memory: their number is copies_per_byte, node A's local
//     copies per remote byte (0 for registered memory, 1 staged through
//     the bounce pool); the fake's speed means nothing.
//   - cluster-small: ioctl-small (4 KiB put + get, each one batch ioctl)
//     on A, where every put is an etcd transaction; the other side is the
//     same on the single-node mount (embedded index), so the ratio is the
//     cost of the shared index.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/rdma"
)

const (
	benchRemoteDir = "remote" // directory of A placed on B
	tcpCeilConns   = 4        // transfer.DefaultTCPOptions().ConnsPerPeer
)

// clusterNodeSize is the capacity of each cluster daemon: room for every
// value a case puts in all its repetitions (and one more), since each
// replaced value's space is reused only after the 5 s free delay; a case
// that waited for it would measure the delay.
func clusterNodeSize(c *benchConfig) uint64 {
	n := uint64(c.reps+1) * (c.size + remoteCUDASize)
	return max(2<<30, (n+2<<20-1)&^(2<<20-1))
}

// etcdBin finds etcd: $MOONCAKE_ETCD, else etcd on PATH, else Debian's.
func etcdBin() string {
	if p := os.Getenv("MOONCAKE_ETCD"); p != "" {
		return p
	}
	if p, err := exec.LookPath("etcd"); err == nil {
		return p
	}
	return "/usr/bin/etcd"
}

func needEtcd() error {
	if _, err := os.Stat(etcdBin()); err != nil {
		return fmt.Errorf("no etcd at %s (apt-get install etcd-server, or MOONCAKE_ETCD): %w", etcdBin(), err)
	}
	return nil
}

// clusterBenchCases are in order of their cluster (benchCase.rdma): one
// runs at a time (stopClusters), and each kind's cases together start it
// once.
func clusterBenchCases() []benchCase {
	return []benchCase{
		{name: "remote-put", target: withCopy, ceiling: "tcp-stream", needs: needEtcd, cluster: benchRemoteDir,
			run: benchRemotePut},
		{name: "remote-get", target: withCopy, ceiling: "tcp-stream", needs: needEtcd, cluster: benchRemoteDir,
			setup: benchIoctlGetSetup, run: benchRemoteGet, teardown: benchIoctlGetTeardown},
		{name: "cluster-small", target: onMount, ceiling: "single-node", needs: needEtcd, cluster: ".",
			small: true, run: benchIoctlSmall},
		{name: "remote-put-rdma", target: withCopy, ceiling: "tcp-stream", needs: needRDMA, cluster: benchRemoteDir, rdma: "rdma",
			run: withRemoteCopies(true, benchRemotePut)},
		{name: "remote-get-rdma", target: withCopy, ceiling: "tcp-stream", needs: needRDMA, cluster: benchRemoteDir, rdma: "rdma",
			setup: benchIoctlGetSetup, run: withRemoteCopies(false, benchRemoteGet), teardown: benchIoctlGetTeardown},
		{name: "remote-put-rdma-fake", target: withCopy, ceiling: "tcp-stream", needs: needEtcd, cluster: benchRemoteDir, rdma: "fake",
			run: withRemoteCopies(true, benchRemotePut)},
		{name: "remote-get-rdma-fake", target: withCopy, ceiling: "tcp-stream", needs: needEtcd, cluster: benchRemoteDir, rdma: "fake",
			setup: benchIoctlGetSetup, run: withRemoteCopies(false, benchRemoteGet), teardown: benchIoctlGetTeardown},
		{name: "remote-put-vm-rdma-fake", target: withCopy, ceiling: "copy", needs: needEtcd, cluster: benchRemoteDir, rdma: "fake",
			run: withRemoteCopies(true, benchIoctlPutVM)},
		{name: "remote-get-vm-rdma-fake", target: withCopy, ceiling: "copy", needs: needEtcd, cluster: benchRemoteDir, rdma: "fake",
			setup: benchIoctlGetSetup, run: withRemoteCopies(false, benchIoctlGetVM), teardown: benchIoctlGetTeardown},
	}
}

// needRDMA: etcd, and an RDMA device with an active port.
func needRDMA() error {
	if err := needEtcd(); err != nil {
		return err
	}
	if why := rdma.Reason(); why != "" {
		return fmt.Errorf("RDMA unavailable: %s", why)
	}
	return nil
}

// withRemoteCopies runs a case and adds node A's local copies per byte
// of remote transfers in the case's direction (put: into B's segments)
// while it ran, from the daemon's status; the case's checks move bytes
// the other way.
func withRemoteCopies(put bool, run func(dir string, p benchParams) (benchSample, error)) func(dir string, p benchParams) (benchSample, error) {
	return func(dir string, p benchParams) (benchSample, error) {
		b0, c0, err := remoteCopies(dir, put)
		if err != nil {
			return benchSample{}, err
		}
		s, err := run(dir, p)
		if err != nil {
			return s, err
		}
		b1, c1, err := remoteCopies(dir, put)
		if err != nil {
			return benchSample{}, err
		}
		if b1 == b0 {
			return benchSample{}, fmt.Errorf("no remote bytes moved from %s", dir)
		}
		v := float64(c1-c0) / float64(b1-b0)
		s.CopiesPerByte = &v
		return s, nil
	}
}

// remoteCopies sums the bytes written (put) or read and their local
// copies on the remote paths, from the status of the mount holding dir.
func remoteCopies(dir string, put bool) (bytes, copied uint64, err error) {
	raw, err := readStatus(filepath.Dir(dir))
	if err != nil {
		return 0, 0, err
	}
	var st Status
	if err := json.Unmarshal(raw, &st); err != nil {
		return 0, 0, err
	}
	for p, ps := range st.Transfer.Paths {
		if p != "tcp" && !strings.HasPrefix(string(p), "rdma-") {
			continue
		}
		if put {
			bytes, copied = bytes+ps.Written, copied+ps.CopiedWritten
		} else {
			bytes, copied = bytes+ps.Read, copied+ps.CopiedRead
		}
	}
	return bytes, copied, nil
}

func benchRemotePut(dir string, p benchParams) (benchSample, error) {
	return ioctlPutBuf(dir, p, func(s benchSample, mem []byte) (benchSample, error) {
		return withTCPCeiling(s, "put", mem)
	})
}

func benchRemoteGet(dir string, p benchParams) (benchSample, error) {
	return ioctlGetBuf(dir, p, func(s benchSample, mem []byte) (benchSample, error) {
		return withTCPCeiling(s, "get", mem)
	})
}

// benchCluster is etcd and two daemons.
type benchCluster struct {
	root string
	etcd *benchProc
	a, b *benchProc
	mnts []string
}

func (c *benchCluster) dir(sub string) string { return filepath.Join(c.mnts[0], sub) }

// freeLoopbackPorts returns n distinct loopback ports that nothing
// listened on just now: all n are held open together while they are
// picked, so that the kernel cannot hand the same one out twice.
func freeLoopbackPorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// startCluster returns the cluster of an RDMA kind ("", "rdma", "fake"),
// started (after stopping any other) unless it runs already.
func (e *benchEnv) startCluster(ctx context.Context, kind string) (*benchCluster, error) {
	if c := e.clusters[kind]; c != nil {
		return c, nil
	}
	if err := e.stopClusters(); err != nil {
		return nil, fmt.Errorf("before the %q cluster: %w", kind, err)
	}
	prefix, flags := "bench", []string{"--rdma", "off"}
	switch kind {
	case "rdma":
		prefix, flags = "rdma", []string{"--rdma", "auto"}
	case "fake":
		prefix, flags = "fake", nil
	}
	c := &benchCluster{root: filepath.Join(e.dir, "cluster-"+prefix)}
	if e.clusters == nil {
		e.clusters = map[string]*benchCluster{}
	}
	e.clusters[kind] = c
	if err := os.Mkdir(c.root, 0o755); err != nil {
		return nil, err
	}
	ports, err := freeLoopbackPorts(2)
	if err != nil {
		return nil, err
	}
	curl := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	purl := fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	if c.etcd, err = e.startProc(ctx, "etcd", "", etcdBin(), "--name", "bench", "--data-dir", filepath.Join(c.root, "etcd"),
		"--listen-client-urls", curl, "--advertise-client-urls", curl, "--listen-peer-urls", purl,
		"--initial-advertise-peer-urls", purl, "--initial-cluster", "bench="+purl, "--log-level", "warn"); err != nil {
		return nil, err
	}
	if err := waitHealthy(ctx, curl); err != nil {
		return nil, err
	}
	token := filepath.Join(c.root, "token")
	if err := os.WriteFile(token, []byte(fmt.Sprintf("bench-token-%d-%d", os.Getpid(), time.Now().UnixNano())), 0o600); err != nil {
		return nil, err
	}
	if kind == "fake" {
		fabric := filepath.Join(c.root, "fabric")
		if err := os.Mkdir(fabric, 0o700); err != nil {
			return nil, err
		}
		flags = []string{"--rdma-fake", fabric}
	}
	for i, name := range []string{prefix + "-a", prefix + "-b"} {
		mnt := filepath.Join(c.root, name)
		if err := os.Mkdir(mnt, 0o755); err != nil {
			return nil, err
		}
		c.mnts = append(c.mnts, mnt)
		args := append([]string{"mount", "--size", fmt.Sprint(e.clusterNodeSize), "--evict", "off",
			"--etcd", curl, "--node", name, "--listen", "127.0.0.1:0", "--token-file", token}, flags...)
		p, err := e.startProc(ctx, name, "READY "+mnt, e.self, append(args, mnt)...)
		if i == 0 {
			c.a = p
		} else {
			c.b = p
		}
		if err != nil {
			return nil, err
		}
	}
	remote := c.dir(benchRemoteDir)
	if err := os.Mkdir(remote, 0o755); err != nil {
		return nil, err
	}
	if err := unix.Setxattr(remote, "user.mooncake.placement", []byte("node:"+prefix+"-b"), 0); err != nil {
		return nil, fmt.Errorf("place %s on %s-b: %w", remote, prefix, err)
	}
	return c, nil
}

// stopClusters stops the clusters running, so that one runs at a time:
// each pins two daemons of clusterNodeSize at mount, and two at once (20
// GiB at the default sizes, with the single-node mount beside them)
// starved a 24 GiB machine until etcd's leases ran out mid-case. A
// cluster stopped here is started again by its next case.
func (e *benchEnv) stopClusters() error {
	var errs []error
	for kind, c := range e.clusters {
		delete(e.clusters, kind)
		if err := c.close(e.failed); err != nil {
			errs = append(errs, fmt.Errorf("stop the %q cluster: %w", kind, err))
		}
	}
	return errors.Join(errs...)
}

func waitHealthy(ctx context.Context, url string) error {
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(benchReadyTimeout)
	for {
		if resp, err := hc.Get(url + "/health"); err == nil {
			ok := resp.StatusCode == http.StatusOK
			resp.Body.Close()
			if ok {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("etcd at %s not healthy after %v", url, benchReadyTimeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// close stops the daemons, then etcd, and removes what they left.
func (c *benchCluster) close(failed bool) error {
	var errs []error
	for _, p := range []*benchProc{c.a, c.b, c.etcd} {
		if p == nil {
			continue
		}
		if err := p.stop(); err != nil {
			errs = append(errs, err)
		}
		if failed {
			dumpTail(os.Stderr, p.log.Name(), 4<<10)
		}
		p.removeLog()
	}
	for _, m := range c.mnts {
		if ok, _ := mountedAt(m); ok {
			if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		_ = os.Remove(m)
	}
	_ = os.RemoveAll(filepath.Join(c.root, "etcd"))
	_ = os.Remove(filepath.Join(c.root, "token"))
	_ = os.RemoveAll(filepath.Join(c.root, "fabric"))
	if err := os.Remove(c.root); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// withTCPCeiling times s.Ops values of len(mem) bytes streamed over
// loopback to (put) or from (get) a sink process, and attaches that as
// the ceiling.
func withTCPCeiling(s benchSample, dir string, mem []byte) (benchSample, error) {
	self, err := os.Executable()
	if err != nil {
		return benchSample{}, err
	}
	cmd := exec.Command(self, "bench", "worker", "tcp-sink", dir, fmt.Sprint(len(mem)), "{}")
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return benchSample{}, err
	}
	if err := cmd.Start(); err != nil {
		return benchSample{}, err
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		return benchSample{}, fmt.Errorf("tcp sink: %w", err)
	}
	addr := strings.TrimSpace(strings.TrimPrefix(line, "ADDR "))
	conns := make([]net.Conn, tcpCeilConns)
	for i := range conns {
		if conns[i], err = net.Dial("tcp", addr); err != nil {
			return benchSample{}, err
		}
		defer conns[i].Close()
	}
	one := func() error { return streamOnce(conns, dir, mem) }
	c, err := timeOps(s.Ops, uint64(len(mem)), one)
	if err != nil {
		return benchSample{}, err
	}
	s.Ceiling = &c
	return s, nil
}

// streamOnce moves mem once: each connection carries its share, then a
// one-byte acknowledgement comes back (put) or goes first (get), as a
// request of the transport does.
func streamOnce(conns []net.Conn, dir string, mem []byte) error {
	share := (len(mem) + len(conns) - 1) / len(conns)
	var wg sync.WaitGroup
	errs := make([]error, len(conns))
	for i, c := range conns {
		part := mem[min(i*share, len(mem)):min((i+1)*share, len(mem))]
		wg.Go(func() {
			var ack [1]byte
			if dir == "put" {
				if _, errs[i] = c.Write(part); errs[i] == nil {
					_, errs[i] = io.ReadFull(c, ack[:])
				}
				return
			}
			if _, errs[i] = c.Write(ack[:]); errs[i] == nil {
				_, errs[i] = io.ReadFull(c, part)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// runTCPSink is the other process of the TCP ceiling: it serves
// tcpCeilConns connections, each receiving (put) or sending (get) its
// share of n bytes per value until the client hangs up.
func runTCPSink(dir, size string) error {
	var n int
	if _, err := fmt.Sscan(size, &n); err != nil || n <= 0 {
		return fmt.Errorf("tcp-sink: size %q", size)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer ln.Close()
	fmt.Printf("ADDR %s\n", ln.Addr())
	buf := make([]byte, n)
	for i := range buf {
		buf[i] = patternByte(i)
	}
	share := (n + tcpCeilConns - 1) / tcpCeilConns
	var wg sync.WaitGroup
	for i := range tcpCeilConns {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		part := buf[min(i*share, n):min((i+1)*share, n)]
		wg.Go(func() {
			defer c.Close()
			var ack [1]byte
			for {
				if dir == "put" {
					if _, err := io.ReadFull(c, part); err != nil {
						return
					}
					if _, err := c.Write(ack[:]); err != nil {
						return
					}
					continue
				}
				if _, err := io.ReadFull(c, ack[:]); err != nil {
					return
				}
				if _, err := c.Write(part); err != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	return nil
}
