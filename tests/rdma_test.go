package tests

// The RDMA transport end to end: daemons of a cluster on loopback whose
// remote extents move over the software NIC (--rdma-fake, a flag only
// tests use), next to a node that has no RDMA and is reached over TCP.

import (
	"encoding/json"
	"fmt"
	"testing"
)

// rdmaStatus is the transfer and rdma parts of status --json.
type rdmaStatus struct {
	Transfer struct {
		Paths map[string]struct {
			Read          uint64 `json:"read"`
			Written       uint64 `json:"written"`
			CopiedRead    uint64 `json:"copied_read"`
			CopiedWritten uint64 `json:"copied_written"`
			Requests      uint64 `json:"requests"`
		} `json:"Paths"`
	} `json:"transfer"`
	RDMA struct {
		State   string   `json:"state"`
		Reason  string   `json:"reason"`
		Devices []string `json:"devices"`
		Stats   *struct {
			Sessions  int    `json:"sessions"`
			Served    int    `json:"served"`
			Exchanges uint64 `json:"exchanges"`
			Broken    uint64 `json:"broken"`
			Fallbacks uint64 `json:"fallbacks"`
			Segments  int    `json:"segments"`
		} `json:"stats"`
	} `json:"rdma"`
}

func (d *daemon) rdmaStatus(t testing.TB) rdmaStatus {
	t.Helper()
	out := run(t, daemonBin(), "status", "--json", d.dir)
	var s rdmaStatus
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	return s
}

// TestClusterRDMA: a registered buffer's put to another node and get
// back go NIC to NIC with no local copy; a plain cp is staged through
// the bounce pool (one copy per byte); a node without RDMA reads the same
// files over TCP; a peer that restarts is connected to again and its old
// incarnation's memory is never used.
func TestClusterRDMA(t *testing.T) {
	requireTools(t, "setfattr")
	fabric := t.TempDir()
	c := newTestCluster(t)
	a := c.start(t, "a", "--rdma-fake", fabric)
	b := c.start(t, "b", "--rdma-fake", fabric)
	cc := c.start(t, "c", "--rdma", "off")
	run(t, "mkdir", a.path("onb"))
	run(t, "setfattr", "-n", "user.mooncake.placement", "-v", "node:b", a.path("onb"))
	src := randomFile(t, 6)
	size := uint64(6<<20 + 4097)

	_, m := client(t, "put", "--buf", a.path("onb", "reg"), src)
	want(t, m, "put", "OK")
	if got := replicaNodes(t, a.path("onb", "reg")); len(got) != 1 || got[0] != "b" {
		t.Fatalf("onb/reg on %v, want [b]", got)
	}
	run(t, "cmp", src, b.path("onb", "reg"))
	back := t.TempDir() + "/back"
	_, m = client(t, "get", "--buf", a.path("onb", "reg"), back)
	want(t, m, "get", "OK")
	run(t, "cmp", src, back)
	s := a.rdmaStatus(t)
	if s.RDMA.State != "on" || s.RDMA.Stats == nil || s.RDMA.Stats.Exchanges != 1 {
		t.Fatalf("rdma on a: %+v", s.RDMA)
	}
	direct := s.Transfer.Paths["rdma-direct"]
	if direct.Written != size || direct.Read != size || direct.CopiedRead+direct.CopiedWritten != 0 {
		t.Fatalf("rdma-direct on a after a registered put and get of %d B: %+v", size, direct)
	}
	if tcp, ok := s.Transfer.Paths["tcp"]; ok {
		t.Fatalf("a moved bytes over TCP: %+v", tcp)
	}

	// Unregistered memory (the kernel's write buffers): staged.
	run(t, "cp", src, a.path("onb", "cp"))
	run(t, "cmp", src, a.path("onb", "cp"))
	staged := a.rdmaStatus(t).Transfer.Paths["rdma-staged"]
	if staged.Written != size || staged.Read < size || staged.CopiedWritten != size || staged.CopiedRead != staged.Read {
		t.Fatalf("rdma-staged on a after cp and cmp of %d B: %+v", size, staged)
	}

	// c has no RDMA: TCP, and b serves no session for it.
	run(t, "cmp", src, cc.path("onb", "cp"))
	sc := cc.rdmaStatus(t)
	if sc.RDMA.State != "off" || sc.Transfer.Paths["tcp"].Read < size {
		t.Fatalf("c: rdma %+v, paths %+v", sc.RDMA, sc.Transfer.Paths)
	}
	sb := b.rdmaStatus(t)
	if sb.RDMA.State != "on" || sb.RDMA.Stats.Served != 1 || sb.RDMA.Stats.Segments != 4 {
		t.Fatalf("rdma on b: %+v", sb.RDMA.Stats)
	}

	// b restarts with empty memory: a's session is of its old life. The
	// old files are gone with it; a new one goes over a new session.
	b.kill9(t)
	b2 := c.start(t, "b", "--rdma-fake", fabric)
	waitFor(t, "a sees b's new life", func() (bool, string) {
		st := a.cluster(t)
		for _, n := range st.Nodes {
			if n.Name == "b" && n.Live {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%+v", st.Nodes)
	})
	_, m = client(t, "put", "--buf", a.path("onb", "again"), src)
	want(t, m, "put", "OK")
	run(t, "cmp", src, b2.path("onb", "again"))
	run(t, "cmp", src, a.path("onb", "again"))
	if st := a.rdmaStatus(t).RDMA.Stats; st.Exchanges != 2 {
		t.Fatalf("rdma on a after b restarted: %+v", st)
	}
}

// TestClusterRDMANodeStoppedMidWrite: the node a write goes to over RDMA
// dies mid-write; the write fails cleanly and nothing partial shows.
func TestClusterRDMANodeStoppedMidWrite(t *testing.T) {
	a := testNodeStoppedMidWrite(t, false, "--rdma-fake", t.TempDir())
	s := a.rdmaStatus(t)
	if s.RDMA.State != "on" || s.Transfer.Paths["rdma-staged"].Written < 8<<20 {
		t.Fatalf("the write did not go over RDMA: %+v %+v", s.RDMA, s.Transfer.Paths)
	}
}

// TestClusterRDMANodeRestartedMidWrite: the same, the node started again
// under its name (on the same fabric) before the writer goes on.
func TestClusterRDMANodeRestartedMidWrite(t *testing.T) {
	testNodeStoppedMidWrite(t, true, "--rdma-fake", t.TempDir())
}

// TestClusterRDMARepair: replicas go to another node over RDMA, and when
// that node dies the repairing node copies its own replica to a third
// one straight from its segment: NIC to NIC, no local copy.
func TestClusterRDMARepair(t *testing.T) {
	requireTools(t, "getfattr", "setfattr")
	fabric := t.TempDir()
	c := newTestCluster(t)
	for _, n := range []string{"a", "b", "c"} {
		c.start(t, n, "--rdma-fake", fabric)
	}
	a := c.nodes["a"]
	run(t, "mkdir", a.path("r"))
	run(t, "setfattr", "-n", "user.mooncake.replicas", "-v", "2", a.path("r"))
	src := randomFile(t, 3)
	size := uint64(3<<20 + 4097)
	run(t, "cp", src, a.path("r", "f"))
	nodes := replicaNodes(t, a.path("r", "f"))
	if len(nodes) != 2 || nodes[0] != "a" {
		t.Fatalf("r/f on %v, want a and another", nodes)
	}
	other := nodes[1]
	third := "b"
	if other == "b" {
		third = "c"
	}
	before := a.rdmaStatus(t).Transfer.Paths["rdma-direct"]
	c.nodes[other].kill9(t)
	waitFor(t, "the replica restored on "+third, func() (bool, string) {
		got := replicaNodes(t, a.path("r", "f"))
		return len(got) == 2 && got[0] == "a" && got[1] == third, fmt.Sprint(got)
	})
	run(t, "cmp", src, c.nodes[third].path("r", "f"))
	after := a.rdmaStatus(t).Transfer.Paths["rdma-direct"]
	if after.Written-before.Written < size || after.CopiedWritten != before.CopiedWritten {
		t.Fatalf("repair from a's segment: rdma-direct %+v -> %+v (want %d B more written, no copy)", before, after, size)
	}
}
