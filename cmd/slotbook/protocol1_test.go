package main

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestProtocol1Keys: a key of protocol 1's layout is listed, marked, with
// what it holds, and counts in none of the subject's figures (the library
// does not read it); a subject that has only such a key is idle; reset
// deletes it with the live keys.
func TestProtocol1Keys(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	first, ten := throttle.Every(time.Second, 1, 0), throttle.Every(10*time.Second, 1, 0)
	lim := e.limiter(t, "api", first, ten)
	ctx := context.Background()
	now := e.redisNow(t)
	for _, s := range []string{"both", "old"} {
		old := e.prefix + "api:{" + s + "}:10s"
		require.NoError(t, e.rdb.Set(ctx, old, strconv.FormatInt(now+60_000_000, 10), 61*time.Second).Err())
	}
	e.book(t, lim, "both", 1)

	var fr struct {
		Subjects int `json:"subjects"`
		Top      []struct {
			Subject   string  `json:"subject"`
			Backlog   float64 `json:"backlog"`
			Available *int    `json:"available"`
			Keys      []struct {
				Key       string  `json:"key"`
				Period    float64 `json:"period"`
				Protocol1 bool    `json:"protocol1"`
				Exists    bool    `json:"exists"`
				TAT       string  `json:"tat"`
			} `json:"keys"`
		} `json:"top"`
	}
	out := e.run(t, "-json", "-limit", "1/1s:0", "-limit", "1/10s:0", "inspect", "api")
	require.NoError(t, json.Unmarshal([]byte(out), &fr), out)
	require.Equal(t, 2, fr.Subjects)
	for _, s := range fr.Top {
		st, err := lim.State(ctx, s.Subject)
		require.NoError(t, err)
		require.Less(t, s.Backlog, 11.0, "%s: the old key's minute is no backlog", s.Subject)
		require.Equal(t, st.Available, *s.Available, s.Subject)
		require.Len(t, s.Keys, 3, s.Subject)
		for i, k := range st.Keys {
			require.Equal(t, e.prefix+k.Key, s.Keys[i].Key)
			require.False(t, s.Keys[i].Protocol1)
		}
		old := s.Keys[2]
		require.Equal(t, e.prefix+"api:{"+s.Subject+"}:10s", old.Key)
		require.True(t, old.Protocol1)
		require.True(t, old.Exists)
		require.Equal(t, 10.0, old.Period)
		require.Equal(t, now+60_000_000, mustParseTime(t, old.TAT).UnixMicro())
	}
	require.Equal(t, "both", fr.Top[0].Subject)
	require.Equal(t, 1, *fr.Top[1].Available, "\"old\" is idle to the library")

	text := e.run(t, "inspect", "api", "old")
	require.Contains(t, text, "(protocol 1 key: not read)")

	e.run(t, "reset", "api", "both")
	for _, k := range []string{"api:{both}", "api:{both}:10000ms", "api:{both}:10s"} {
		_, ok := e.tatOf(t, e.prefix+k)
		require.False(t, ok, k)
	}
	_, ok := e.tatOf(t, e.prefix+"api:{old}:10s")
	require.True(t, ok, "another subject's old key stays")
}
