package store_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// create makes an empty file at key, with its parents.
func (s *testStore) create(t testing.TB, key string) *store.Object {
	t.Helper()
	s.mkdirAll(t, key)
	o, err := s.Create(context.Background(), key, nil, true)
	if err != nil {
		t.Fatalf("create %q: %v", key, err)
	}
	return o
}

func (s *testStore) mkdir(t testing.TB, key string) *store.Object {
	t.Helper()
	s.mkdirAll(t, key)
	o, err := s.Mkdir(context.Background(), key, nil)
	if err != nil {
		t.Fatalf("mkdir %q: %v", key, err)
	}
	return o
}

func (s *testStore) keys(t testing.TB) []string {
	t.Helper()
	objs, err := s.Index.Scan(context.Background(), "", "", 0)
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, o := range objs {
		keys = append(keys, o.Key)
	}
	return keys
}

type entry struct {
	name     string
	kind     store.Kind
	implicit bool
}

func checkList(t *testing.T, s *testStore, dir string, want []entry) {
	t.Helper()
	es, err := s.List(context.Background(), dir)
	if err != nil {
		t.Fatalf("List(%q): %v", dir, err)
	}
	var got []entry
	for _, e := range es {
		got = append(got, entry{e.Name, e.Kind, e.Object == nil})
		if e.Object != nil && (e.Object.Ino != e.Ino || e.Object.Key != store.Join(dir, e.Name)) {
			t.Errorf("List(%q): entry %q ino %d carries object %q ino %d", dir, e.Name, e.Ino, e.Object.Key, e.Object.Ino)
		}
		if e.Object == nil && e.Ino>>63 == 0 {
			t.Errorf("List(%q): implicit %q has inode %#x without the implicit bit", dir, e.Name, e.Ino)
		}
		// Stat agrees with the listing.
		st, err := s.Stat(context.Background(), store.Join(dir, e.Name))
		if err != nil || st.Ino != e.Ino || st.Kind != e.Kind {
			t.Errorf("Stat(%q) = %+v, %v; List said ino %d kind %d", store.Join(dir, e.Name), st, err, e.Ino, e.Kind)
		}
	}
	if !slices.Equal(got, want) {
		t.Fatalf("List(%q) =\n  %v\nwant\n  %v", dir, got, want)
	}
}

func TestStat(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	root, err := s.Stat(ctx, "")
	if err != nil || root.Kind != store.KindDir || root.Ino != 1 {
		t.Fatalf("Stat(root) = %+v, %v", root, err)
	}
	s.create(t, "a/b/c")
	s.makeImplicit(t, "a/b")
	s.makeImplicit(t, "a")
	for _, k := range []string{"a", "a/b"} {
		o, err := s.Stat(ctx, k)
		if err != nil || o.Kind != store.KindDir || o.Version != 0 || o.Ino>>63 != 1 {
			t.Fatalf("Stat(%q) = %+v, %v; want an implicit directory", k, o, err)
		}
		again, _ := s.Stat(ctx, k)
		if again.Ino != o.Ino {
			t.Fatalf("implicit inode of %q not stable: %d, %d", k, o.Ino, again.Ino)
		}
	}
	if a, b := mustStat(t, s, "a"), mustStat(t, s, "a/b"); a.Ino == b.Ino {
		t.Fatal("two implicit directories share an inode")
	}
	for _, k := range []string{"a/b/c/d", "a/x", "b", "a/b/"} {
		if _, err := s.Stat(ctx, k); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("Stat(%q): %v, want ErrNotFound", k, err)
		}
	}
}

func mustStat(t testing.TB, s *testStore, key string) *store.Object {
	t.Helper()
	o, err := s.Stat(context.Background(), key)
	if err != nil {
		t.Fatalf("Stat(%q): %v", key, err)
	}
	return o
}

// List with children whose names sort around '/': in key order "d/a-",
// "d/a.b" sort before the subtree "d/a/..." and "d/a0" after it.
func TestList(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	for _, k := range []string{"d/a/x", "d/a/y/z", "d/a-", "d/a.b", "d/a0", "d/f/g", "d/h/i/j", "d/z", "top"} {
		s.create(t, k)
	}
	s.mkdir(t, "d/e")
	s.makeImplicit(t, "d/a/y")
	s.makeImplicit(t, "d/a")
	s.makeImplicit(t, "d/h/i")
	s.makeImplicit(t, "d/h")
	checkList(t, s, "d", []entry{
		{"a", store.KindDir, true},
		{"a-", store.KindFile, false},
		{"a.b", store.KindFile, false},
		{"a0", store.KindFile, false},
		{"e", store.KindDir, false},
		{"f", store.KindDir, false},
		{"h", store.KindDir, true},
		{"z", store.KindFile, false},
	})
	checkList(t, s, "", []entry{{"d", store.KindDir, false}, {"top", store.KindFile, false}})
	checkList(t, s, "d/a", []entry{{"x", store.KindFile, false}, {"y", store.KindDir, true}})
	checkList(t, s, "d/h", []entry{{"i", store.KindDir, true}})
	checkList(t, s, "d/e", nil)

	// The same names with "a" an explicit directory.
	for _, k := range []string{"e/a/x", "e/a.b", "e/a0", "e/a-"} {
		s.create(t, k)
	}
	checkList(t, s, "e", []entry{
		{"a", store.KindDir, false},
		{"a-", store.KindFile, false},
		{"a.b", store.KindFile, false},
		{"a0", store.KindFile, false},
	})

	if _, err := s.List(ctx, "d/z"); !errors.Is(err, store.ErrNotDir) {
		t.Errorf("List(file): %v, want ErrNotDir", err)
	}
	if _, err := s.List(ctx, "nope"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("List(missing): %v, want ErrNotFound", err)
	}
}

// A listing longer than one index scan batch, with big implicit subtrees
// that straddle batch boundaries.
func TestListLarge(t *testing.T) {
	s := newTestStore(t, 1<<20)
	var want []entry
	s.mkdir(t, "big")
	for i := range 700 {
		name := fmt.Sprintf("f%04d", i)
		switch i % 100 {
		case 10: // a subtree of 300 keys
			for j := range 300 {
				s.create(t, fmt.Sprintf("big/%s/%03d", name, j))
			}
			s.makeImplicit(t, "big/"+name)
			want = append(want, entry{name, store.KindDir, true})
			// Siblings that sort on both sides of "name/".
			s.create(t, "big/"+name+".x")
			s.create(t, "big/"+name+"0")
			want = append(want, entry{name + ".x", store.KindFile, false}, entry{name + "0", store.KindFile, false})
			continue
		case 20:
			s.mkdir(t, "big/"+name)
			want = append(want, entry{name, store.KindDir, false})
			continue
		}
		s.create(t, "big/"+name)
		want = append(want, entry{name, store.KindFile, false})
	}
	slices.SortFunc(want, func(a, b entry) int { return strings.Compare(a.name, b.name) })
	checkList(t, s, "big", want)
}

func TestCreateAndMkdir(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	o, err := s.Create(ctx, "f", &store.Object{Mode: 0o100640, Uid: 3, Gid: 4, Xattrs: map[string][]byte{"k": []byte("v")}}, true)
	if err != nil {
		t.Fatal(err)
	}
	if o.Kind != store.KindFile || o.Mode != 0o640 || o.Uid != 3 || o.Gid != 4 || string(o.Xattrs["k"]) != "v" || o.Size != 0 || o.Ino == 0 {
		t.Fatalf("created %+v", o)
	}
	if _, err := s.Create(ctx, "f", nil, true); !errors.Is(err, store.ErrExists) {
		t.Fatalf("exclusive create of an existing file: %v", err)
	}
	if again, err := s.Create(ctx, "f", nil, false); err != nil || again.Ino != o.Ino {
		t.Fatalf("non-exclusive create = %+v, %v; want the existing file", again, err)
	}
	d, err := s.Mkdir(ctx, "d", nil)
	if err != nil || d.Kind != store.KindDir || d.Mode != 0o755 {
		t.Fatalf("Mkdir = %+v, %v", d, err)
	}
	for _, tc := range []struct {
		op, key string
		want    error
	}{
		{"create", "d", store.ErrIsDir},
		{"create", "missing/f", store.ErrNotFound},
		{"create", "f/g", store.ErrNotDir},
		{"mkdir", "d", store.ErrExists},
		{"mkdir", "f", store.ErrExists},
		{"mkdir", "missing/d", store.ErrNotFound},
		{"mkdir", "f/d", store.ErrNotDir},
	} {
		var err error
		if tc.op == "create" {
			_, err = s.Create(ctx, tc.key, nil, false)
		} else {
			_, err = s.Mkdir(ctx, tc.key, nil)
		}
		wantErr(t, tc.op+" "+tc.key, err, tc.want)
	}
	// Implicit directories count as directories.
	s.create(t, "i/x")
	s.makeImplicit(t, "i")
	if _, err := s.Mkdir(ctx, "i", nil); !errors.Is(err, store.ErrExists) {
		t.Fatalf("mkdir over an implicit directory: %v", err)
	}
	if _, err := s.Create(ctx, "i", nil, false); !errors.Is(err, store.ErrIsDir) {
		t.Fatalf("create over an implicit directory: %v", err)
	}
	if _, err := s.Create(ctx, "i/y", nil, true); err != nil {
		t.Fatalf("create inside an implicit directory: %v", err)
	}
}

func TestRmdir(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	s.create(t, "d/sub/f")
	s.mkdir(t, "d/empty")
	s.create(t, "imp/f")
	s.makeImplicit(t, "imp")
	wantErr(t, "rmdir of a directory with a file", s.Rmdir(ctx, "d/sub"), store.ErrNotEmpty)
	wantErr(t, "rmdir of a directory with a directory", s.Rmdir(ctx, "d"), store.ErrNotEmpty)
	wantErr(t, "rmdir of an implicit directory", s.Rmdir(ctx, "imp"), store.ErrNotEmpty)
	wantErr(t, "rmdir of a file", s.Rmdir(ctx, "d/sub/f"), store.ErrNotDir)
	wantErr(t, "rmdir of nothing", s.Rmdir(ctx, "nope"), store.ErrNotFound)
	if err := s.Rmdir(ctx, "d/empty"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Stat(ctx, "d/empty"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("Stat after rmdir: %v", err)
	}
	if err := s.Delete(ctx, "d/sub/f", 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Rmdir(ctx, "d/sub"); err != nil {
		t.Fatal(err)
	}
	if err := s.Rmdir(ctx, "d"); err != nil {
		t.Fatal(err)
	}
	if keys := s.keys(t); !slices.Equal(keys, []string{"imp/f"}) {
		t.Fatalf("keys = %q", keys)
	}
}

// Deleting the last file of an implicit directory keeps the directory
// (rm -r and mv expect it to stay), with the same inode.
func TestDeleteKeepsImplicitParent(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	s.put(t, "solo", []byte("x")) // a root file: nothing to keep
	s.mkdirAll(t, "p/q/f")
	s.put(t, "p/q/f", pattern(1, 9000))
	s.makeImplicit(t, "p/q")
	s.makeImplicit(t, "p")
	ino := mustStat(t, s, "p/q").Ino
	if err := s.Delete(ctx, "p/q/f", 0); err != nil {
		t.Fatal(err)
	}
	q := mustStat(t, s, "p/q")
	if q.Kind != store.KindDir || q.Version == 0 || q.Ino != ino {
		t.Fatalf("p/q after deleting its last file = %+v; want an explicit directory with inode %d", q, ino)
	}
	if p := mustStat(t, s, "p"); p.Version != 0 {
		t.Fatalf("p = %+v; want it still implicit (it holds p/q)", p)
	}
	checkList(t, s, "p/q", nil)
	// Removing that directory materializes its parent in turn.
	if err := s.Rmdir(ctx, "p/q"); err != nil {
		t.Fatal(err)
	}
	if p := mustStat(t, s, "p"); p.Version == 0 {
		t.Fatalf("p = %+v; want it explicit after its last child went", p)
	}
	if err := s.Delete(ctx, "solo", 0); err != nil {
		t.Fatal(err)
	}
	if keys := s.keys(t); !slices.Equal(keys, []string{"p"}) {
		t.Fatalf("keys = %q", keys)
	}
	if u := s.used(); u != 0 {
		t.Fatalf("Used = %d", u)
	}
}

func TestDeleteErrors(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	o := s.create(t, "f")
	s.create(t, "imp/x")
	s.makeImplicit(t, "imp")
	s.mkdir(t, "d")
	wantErr(t, "delete missing", s.Delete(ctx, "nope", 0), store.ErrNotFound)
	wantErr(t, "delete dir", s.Delete(ctx, "d", 0), store.ErrIsDir)
	wantErr(t, "delete implicit dir", s.Delete(ctx, "imp", 0), store.ErrIsDir)
	wantErr(t, "delete other inode", s.Delete(ctx, "f", o.Ino+1), store.ErrStale)
	if err := s.Delete(ctx, "f", o.Ino); err != nil {
		t.Fatal(err)
	}
}

// TestUpdateRoot: the root's attributes change as often as asked, each
// update over the last, and no listing shows where they are kept.
func TestUpdateRoot(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	s.put(t, "f", pattern(1, 10))
	var last uint64
	for i, mode := range []uint32{0o700, 0o1777, 0o755} {
		n, err := s.Update(ctx, "", 1, func(n *store.Object) error { n.Mode, n.Uid = mode, uint32(i); return nil })
		if err != nil {
			t.Fatalf("update %d of the root: %v", i, err)
		}
		if n.Key != "" || n.Kind != store.KindDir || n.Ino != 1 || n.Version <= last {
			t.Fatalf("update %d of the root: %+v", i, n)
		}
		last = n.Version
		o, err := s.Stat(ctx, "")
		if err != nil || o.Mode != mode || o.Uid != uint32(i) || o.Key != "" || o.Version != n.Version {
			t.Fatalf("root after update %d: %+v, %v", i, o, err)
		}
	}
	ents, err := s.List(ctx, "")
	if err != nil || len(ents) != 1 || ents[0].Name != "f" {
		t.Fatalf("root lists %+v, %v; want f alone", ents, err)
	}
}

func TestUpdate(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	o := s.put(t, "f", pattern(1, 5000))
	n, err := s.Update(ctx, "f", o.Ino, func(n *store.Object) error {
		n.Pinned, n.Mode = true, 0o600
		n.Size, n.Key, n.Ino, n.Replicas = 1, "other", 5, nil // ignored
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !n.Pinned || n.Mode != 0o600 || n.Size != 5000 || n.Key != "f" || n.Ino != o.Ino || n.Version <= o.Version {
		t.Fatalf("updated %+v", n)
	}
	equalBytes(t, "content after update", s.read(t, "f"), pattern(1, 5000))
	if _, err := s.Update(ctx, "f", o.Ino+1, func(*store.Object) error { return nil }); !errors.Is(err, store.ErrStale) {
		t.Fatalf("update of another inode: %v", err)
	}
	boom := errors.New("boom")
	if _, err := s.Update(ctx, "f", 0, func(*store.Object) error { return boom }); !errors.Is(err, boom) {
		t.Fatalf("fn error: %v", err)
	}
	if _, err := s.Update(ctx, "nope", 0, func(*store.Object) error { return nil }); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("update missing: %v", err)
	}
	if u := s.used(); u != roundUp(5000) {
		t.Fatalf("Used = %d", u)
	}
}

func TestRenameFileOverFile(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	a, b := pattern(1, 50_000), pattern(2, 80_000)
	oa := s.put(t, "a", a)
	s.put(t, "b", b)
	s.put(t, "c", pattern(3, 20_000))
	rb, err := s.OpenReader(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Rename(ctx, "a", "b", 0); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Stat(ctx, "a"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("Stat(a) after rename: %v", err)
	}
	if nb := mustStat(t, s, "b"); nb.Ino != oa.Ino || nb.Size != uint64(len(a)) {
		t.Fatalf("b after rename = %+v; want a's inode %d", nb, oa.Ino)
	}
	equalBytes(t, "b after rename", s.read(t, "b"), a)
	got, _ := readAll(rb)
	equalBytes(t, "reader of the replaced b", got, b)
	want := roundUp(50_000) + roundUp(80_000) + roundUp(20_000)
	if u := s.used(); u != want {
		t.Fatalf("Used = %d with the replaced body held, want %d", u, want)
	}
	rb.Close()
	want -= roundUp(80_000)
	if u := s.used(); u != want {
		t.Fatalf("Used = %d after the replaced body's reader closed, want %d", u, want)
	}
	// Without a reader the replaced body goes at once.
	if err := s.Rename(ctx, "c", "b", 0); err != nil {
		t.Fatal(err)
	}
	if u := s.used(); u != roundUp(20_000) {
		t.Fatalf("Used = %d after c replaced b, want %d", u, roundUp(20_000))
	}
	if st := s.Stats(); st.Objects != 1 {
		t.Fatalf("LRU holds %d objects, want 1", st.Objects)
	}
	// Renaming onto itself changes nothing.
	if err := s.Rename(ctx, "b", "b", 0); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "b", s.read(t, "b"), pattern(3, 20_000))
}

func TestRenameErrors(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	s.put(t, "f", []byte("f"))
	s.put(t, "g", []byte("g"))
	s.mkdir(t, "empty")
	s.create(t, "full/x")
	s.create(t, "imp/x")
	s.makeImplicit(t, "imp")
	before := s.keys(t)
	for _, tc := range []struct {
		from, to string
		flags    uint32
		want     error
	}{
		{"f", "empty", 0, store.ErrIsDir},
		{"f", "imp", 0, store.ErrIsDir},
		{"f", "full", 0, store.ErrIsDir},
		{"full", "f", 0, store.ErrNotDir},
		{"full", "imp", 0, store.ErrNotEmpty},
		{"imp", "full", 0, store.ErrNotEmpty},
		{"f", "g", store.RenameNoReplace, store.ErrExists},
		{"full", "empty", store.RenameNoReplace, store.ErrExists},
		{"full", "full/sub", 0, store.ErrInvalid},
		{"full", "full/x/deeper", 0, store.ErrInvalid},
		{"imp", "imp/y", 0, store.ErrInvalid},
		{"f", "g", store.RenameExchange, store.ErrUnsupported},
		{"f", "g", 1 << 7, store.ErrInvalid},
		{"nope", "h", 0, store.ErrNotFound},
		{"f", "nope/h", 0, store.ErrNotFound},
		{"f", "g/h", 0, store.ErrNotDir},
		{"f", "bad//name", 0, store.ErrInvalidName},
		{"f", strings.Repeat("n", 256), 0, store.ErrNameTooLong},
	} {
		err := s.Rename(ctx, tc.from, tc.to, tc.flags)
		wantErr(t, fmt.Sprintf("rename %q -> %q (flags %#x)", tc.from, tc.to, tc.flags), err, tc.want)
		if keys := s.keys(t); !slices.Equal(keys, before) {
			t.Fatalf("failed rename %q -> %q changed the keys: %q", tc.from, tc.to, keys)
		}
	}
	equalBytes(t, "f", s.read(t, "f"), []byte("f"))
	equalBytes(t, "g", s.read(t, "g"), []byte("g"))
	// What is allowed: a directory over an empty one, no-replace to a new name.
	if err := s.Rename(ctx, "full", "empty", 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Rename(ctx, "f", "h", store.RenameNoReplace); err != nil {
		t.Fatal(err)
	}
	want := []string{"empty", "empty/x", "g", "h", "imp/x"}
	if keys := s.keys(t); !slices.Equal(keys, want) {
		t.Fatalf("keys = %q, want %q", keys, want)
	}
}

func TestRenameDirectory(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	files := map[string][]byte{
		"src/a":     pattern(1, 5000),
		"src/b/c":   pattern(2, 9000),
		"src/b/d":   pattern(3, 100),
		"src.x":     pattern(4, 10), // siblings that share the prefix "src"
		"src0":      pattern(5, 10),
		"src/b.txt": pattern(6, 10),
	}
	inos := map[string]uint64{}
	for _, k := range slices.Sorted(mapsKeys(files)) {
		s.mkdirAll(t, k)
		inos[k] = s.put(t, k, files[k]).Ino
	}
	s.mkdir(t, "src/e")
	s.mkdir(t, "dst")
	dirIno := mustStat(t, s, "src").Ino
	r, err := s.OpenReader(ctx, "src/b/c")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	used := s.used()
	if err := s.Rename(ctx, "src", "dst/new", 0); err != nil {
		t.Fatal(err)
	}
	want := []string{"dst", "dst/new", "dst/new/a", "dst/new/b", "dst/new/b.txt", "dst/new/b/c", "dst/new/b/d", "dst/new/e", "src.x", "src0"}
	if keys := s.keys(t); !slices.Equal(keys, want) {
		t.Fatalf("keys after rename =\n  %q\nwant\n  %q", keys, want)
	}
	if o := mustStat(t, s, "dst/new"); o.Ino != dirIno || o.Kind != store.KindDir {
		t.Fatalf("moved directory = %+v", o)
	}
	for k, data := range files {
		nk := k
		if strings.HasPrefix(k, "src/") {
			nk = "dst/new/" + k[len("src/"):]
		}
		equalBytes(t, nk, s.read(t, nk), data)
		if o := mustStat(t, s, nk); o.Ino != inos[k] {
			t.Errorf("%s: inode %d, want %d", nk, o.Ino, inos[k])
		}
	}
	got, _ := readAll(r)
	equalBytes(t, "reader opened before the rename", got, files["src/b/c"])
	if u := s.used(); u != used {
		t.Fatalf("Used = %d after a rename, want %d (nothing copied or freed)", u, used)
	}
	if st := s.Stats(); st.Objects != len(files) {
		t.Fatalf("LRU holds %d objects, want %d", st.Objects, len(files))
	}

	// An implicit directory moves too, and stays implicit.
	s.makeImplicit(t, "dst/new/b")
	if err := s.Rename(ctx, "dst/new/b", "moved", 0); err != nil {
		t.Fatal(err)
	}
	checkList(t, s, "moved", []entry{{"c", store.KindFile, false}, {"d", store.KindFile, false}})
	if o := mustStat(t, s, "moved"); o.Version != 0 {
		t.Fatalf("moved = %+v; want implicit", o)
	}
	checkList(t, s, "dst/new", []entry{{"a", store.KindFile, false}, {"b.txt", store.KindFile, false}, {"e", store.KindDir, false}})
}

func mapsKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// A directory made explicit where it was implicit bears the inode number
// of an implicit directory at its key. Moved away it takes one of its
// own: a new implicit directory at the old key gets the old number, and
// two directories of one number would be one to the kernel (a loop of
// directories in the mount's inode tree, found by a rename race).
func TestMovedImplicitBornDirectoryTakesOwnInode(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	s.create(t, "d/f")
	s.create(t, "e/sub/g")
	s.makeImplicit(t, "d")
	s.makeImplicit(t, "e/sub")
	s.makeImplicit(t, "e")
	if err := s.Delete(ctx, "d/f", 0); err != nil {
		t.Fatal(err)
	}
	born := mustStat(t, s, "d") // explicit now, with the implicit number
	if born.Version == 0 {
		t.Fatalf("d = %+v; want explicit", born)
	}
	if err := s.Rename(ctx, "d", "moved", 0); err != nil {
		t.Fatal(err)
	}
	// Its subtree moved along: e/sub, implicit-born too, once e/sub/g goes.
	if err := s.Delete(ctx, "e/sub/g", 0); err != nil {
		t.Fatal(err)
	}
	sub := mustStat(t, s, "e/sub")
	if err := s.Rename(ctx, "e", "moved/e", 0); err != nil {
		t.Fatal(err)
	}
	s.create(t, "d/again")
	s.create(t, "e/sub/again")
	s.makeImplicit(t, "d")
	s.makeImplicit(t, "e/sub")
	s.makeImplicit(t, "e")
	seen := map[uint64]string{}
	for _, k := range []string{"d", "moved", "e", "e/sub", "moved/e", "moved/e/sub"} {
		o := mustStat(t, s, k)
		if o.Kind != store.KindDir {
			t.Fatalf("%s = %+v; want a directory", k, o)
		}
		if other, dup := seen[o.Ino]; dup {
			t.Fatalf("%s and %s share inode %#x", k, other, o.Ino)
		}
		seen[o.Ino] = k
	}
	if o := mustStat(t, s, "moved/e/sub"); o.Version == 0 || o.Ino == sub.Ino {
		t.Fatalf("moved/e/sub = %+v; want explicit with a number of its own (was %#x)", o, sub.Ino)
	}
}

// Moving the last child out of an implicit directory keeps the directory.
func TestRenameKeepsOldParent(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	s.create(t, "m/f")
	s.create(t, "n/sub/g")
	s.makeImplicit(t, "m")
	s.makeImplicit(t, "n/sub")
	s.makeImplicit(t, "n")
	ino := mustStat(t, s, "m").Ino
	if err := s.Rename(ctx, "m/f", "g", 0); err != nil {
		t.Fatal(err)
	}
	if o := mustStat(t, s, "m"); o.Version == 0 || o.Ino != ino {
		t.Fatalf("m = %+v; want explicit with inode %d", o, ino)
	}
	// Within the same parent nothing needs keeping.
	if err := s.Rename(ctx, "n/sub/g", "n/sub/h", 0); err != nil {
		t.Fatal(err)
	}
	if o := mustStat(t, s, "n/sub"); o.Version != 0 {
		t.Fatalf("n/sub = %+v; want still implicit", o)
	}
	// Moving the whole subtree out keeps "n".
	if err := s.Rename(ctx, "n/sub", "sub", 0); err != nil {
		t.Fatal(err)
	}
	if o := mustStat(t, s, "n"); o.Version == 0 {
		t.Fatalf("n = %+v; want explicit", o)
	}
	want := []string{"g", "m", "n", "sub/h"}
	if keys := s.keys(t); !slices.Equal(keys, want) {
		t.Fatalf("keys = %q, want %q", keys, want)
	}
}

func TestNameValidation(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	n255 := strings.Repeat("x", 255)
	// 16 components of 255 bytes and 15 slashes: 4095 bytes, the limit.
	long := strings.TrimSuffix(strings.Repeat(strings.Repeat("y", 255)+"/", 16), "/")
	if len(long) != store.MaxKeyLen {
		t.Fatalf("test key is %d B", len(long))
	}
	for _, tc := range []struct {
		key  string
		want error
	}{
		{n255, nil},
		{"d/" + n255, nil},
		{long, nil},
		{strings.Repeat("x", 256), store.ErrNameTooLong},
		{"d/" + strings.Repeat("x", 256), store.ErrNameTooLong},
		{long + "x", store.ErrNameTooLong}, // 4096 bytes
		{strings.Repeat("a/", 2048), store.ErrNameTooLong},
		{"a/../b", store.ErrInvalidName},
		{"a/./b", store.ErrInvalidName},
		{"..", store.ErrInvalidName},
		{"", store.ErrInvalidName},
		{"/a", store.ErrInvalidName},
		{"a/", store.ErrInvalidName},
		{"a//b", store.ErrInvalidName},
		{"a\x00b", store.ErrInvalidName},
	} {
		name := tc.key
		if len(name) > 40 {
			name = fmt.Sprintf("%.20q...(%d B)", name, len(name))
		}
		if err := store.ValidateKey(tc.key); !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Errorf("ValidateKey(%s): %v, want %v", name, err, tc.want)
		}
		if tc.want == nil {
			s.mkdirAll(t, tc.key)
			if _, err := s.Create(ctx, tc.key, nil, true); err != nil {
				t.Errorf("Create(%s): %v", name, err)
			}
			continue
		}
		_, err := s.Create(ctx, tc.key, nil, true)
		wantErr(t, "Create("+name+")", err, tc.want)
		_, err = s.Mkdir(ctx, tc.key, nil)
		wantErr(t, "Mkdir("+name+")", err, tc.want)
		wantErr(t, "Rename(d, "+name+")", s.Rename(ctx, "d", tc.key, 0), tc.want)
		d := s.NewDraft(store.NewIno(), nil, true)
		_, err = d.Commit(ctx, store.CommitOptions{Key: tc.key})
		d.Close()
		wantErr(t, "Commit("+name+")", err, tc.want)
	}
	if err := store.ValidateName("a/b"); !errors.Is(err, store.ErrInvalidName) {
		t.Errorf("ValidateName(a/b): %v", err)
	}
}

// TestListPage: a directory read a page at a time, with pages of 1 to
// more than it holds, lists what List lists (in key order, not sorted),
// each child once: files, explicit directories with and without
// children, implicit ones, names that sort between a directory and its
// subtree ("b-x" between "b" and "b/"). The position of the next page
// is relative to the directory, so a listing renamed between pages goes
// on where it was; children neither added nor removed meanwhile are
// listed once, whatever changes around them between the pages.
func TestListPage(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	for _, k := range []string{"d/a", "d/b-x", "d/b.y", "d/b/c", "d/b/c2", "d/c/deep/x", "d/c.z", "d/f0", "d/f1", "d/g/h", "d/g/i/j", "top"} {
		s.create(t, k)
	}
	s.mkdir(t, "d/e")
	for _, d := range []string{"d/c/deep", "d/c", "d/g/i", "d/g"} {
		s.makeImplicit(t, d) // "d/b" stays explicit, with children
	}
	want, err := s.List(ctx, "d")
	if err != nil {
		t.Fatal(err)
	}
	names := func(es []store.DirEntry) []string {
		var out []string
		for _, e := range es {
			out = append(out, e.Name)
		}
		slices.Sort(out)
		return out
	}
	list := func(dir string, limit int, between func(page int)) []store.DirEntry {
		var all []store.DirEntry
		for page, after := 0, ""; ; page++ {
			es, next, err := s.ListPage(ctx, dir, after, limit)
			if err != nil {
				t.Fatalf("page %d of %q (limit %d): %v", page, dir, limit, err)
			}
			if len(es) > limit {
				t.Fatalf("page %d: %d entries, limit %d", page, len(es), limit)
			}
			all = append(all, es...)
			if next == "" {
				return all
			}
			if between != nil {
				between(page)
			}
			after = next
		}
	}
	for limit := 1; limit <= 14; limit++ {
		got := list("d", limit, nil)
		if !slices.Equal(names(got), names(want)) {
			t.Fatalf("limit %d: %v, List %v", limit, names(got), names(want))
		}
		for _, e := range got {
			i := slices.IndexFunc(want, func(w store.DirEntry) bool { return w.Name == e.Name })
			if w := want[i]; w.Kind != e.Kind || w.Ino != e.Ino || (w.Object == nil) != (e.Object == nil) {
				t.Fatalf("limit %d: %q is %+v, List has %+v", limit, e.Name, e, w)
			}
		}
	}
	if got := names(list("", 1, nil)); !slices.Equal(got, []string{"d", "top"}) {
		t.Fatalf("root: %v", got)
	}
	if _, _, err := s.ListPage(ctx, "top", "", 5); !errors.Is(err, store.ErrNotDir) {
		t.Fatalf("a file listed: %v", err)
	}
	// Renamed between pages: the listing goes on in the new place, each
	// child once.
	dir, renamed := "d", false
	var all []store.DirEntry
	for after := ""; ; {
		es, next, err := s.ListPage(ctx, dir, after, 3)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, es...)
		if next == "" {
			break
		}
		if !renamed {
			if err := s.Rename(ctx, "d", "d2", 0); err != nil {
				t.Fatal(err)
			}
			dir, renamed = "d2", true
		}
		after = next
	}
	if !slices.Equal(names(all), names(want)) {
		t.Fatalf("renamed after the first page: %v, want %v", names(all), names(want))
	}
	// Listing "d2" now, a page at a time, while other children come and
	// go between the pages: the ones that stay are listed once each.
	var churn int
	got := list("d2", 2, func(page int) {
		churn++
		s.create(t, fmt.Sprintf("d2/new%d", churn))
		s.create(t, fmt.Sprintf("d2/b/new%d", churn))
		if err := s.Delete(ctx, fmt.Sprintf("d2/new%d", churn), 0); err != nil {
			t.Fatal(err)
		}
	})
	seen := map[string]int{}
	for _, e := range got {
		seen[e.Name]++
	}
	for _, w := range want {
		if seen[w.Name] != 1 {
			t.Fatalf("%q listed %d times while others changed: %v", w.Name, seen[w.Name], names(got))
		}
	}
}

// TestDeleteRacingCreate: a delete of a key that a create makes at the
// same moment either removes it or finds nothing; it never calls the
// key a directory (as it did when the key came between its lookup and
// its check for a directory there).
func TestDeleteRacingCreate(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range 3000 {
				var err error
				if (i+w)%2 == 0 {
					_, err = s.Create(ctx, "f", nil, false)
				} else {
					err = s.Delete(ctx, "f", 0)
				}
				if err != nil && !errors.Is(err, store.ErrNotFound) && !errors.Is(err, store.ErrExists) {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
}
