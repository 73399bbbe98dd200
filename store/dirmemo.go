package store

// DirMemo maps directory keys to what a call found of them, its first
// directory held inline: the keys of a call (a batch, a commit) mostly
// share one directory, and a one-key call has only one, so most calls
// make no map (making and filling a small Go map cost a one-key put
// about half a microsecond).
// A directory is inline or in more, never both. The zero value is empty.
type DirMemo[V any] struct {
	key  string
	val  V
	has  bool
	more map[string]V // the directories besides the inline one
}

// Get returns dir's value and whether the memo has one.
func (m *DirMemo[V]) Get(dir string) (V, bool) {
	if m.has && m.key == dir {
		return m.val, true
	}
	v, ok := m.more[dir]
	return v, ok
}

// Put sets dir's value.
func (m *DirMemo[V]) Put(dir string, v V) {
	if m.has && m.key == dir {
		m.val = v
		return
	}
	if _, ok := m.more[dir]; ok || m.has {
		if m.more == nil {
			m.more = map[string]V{}
		}
		m.more[dir] = v
		return
	}
	m.key, m.val, m.has = dir, v, true
}

// Forget drops dir's value, if the memo has one.
func (m *DirMemo[V]) Forget(dir string) {
	if m.has && m.key == dir {
		var zero V
		m.key, m.val, m.has = "", zero, false
		return
	}
	delete(m.more, dir)
}
