//! Who a connection is and what it reports about itself: AUTH, HELLO,
//! CLIENT.

use super::*;

impl Session<'_> {
    pub(super) fn bind(&mut self, p: Principal) {
        self.ns = match &p {
            Principal::Admin => DEFAULT_NAMESPACE.to_string(),
            Principal::Namespace(n) => n.clone(),
            Principal::Metrics => DEFAULT_NAMESPACE.to_string(),
        };
        self.principal = Some(p);
    }

    pub(super) fn authenticate(&mut self, user: Option<&[u8]>, pass: &[u8]) -> Result<(), CmdError> {
        if self.ctx.auth.is_open() {
            return Err(CmdError::AuthNotConfigured);
        }
        // `default` is the name Redis clients send when they have only a password.
        let ns = user.filter(|u| !is(u, "default")).map(|u| String::from_utf8_lossy(u).into_owned());
        match self.ctx.auth.authenticate(ns.as_deref(), pass) {
            // The metrics token is for HTTP `/metrics` alone.
            Some(Principal::Metrics) | None => Err(CmdError::WrongPass),
            Some(p) => {
                self.bind(p);
                Ok(())
            }
        }
    }

    pub(super) fn auth(&mut self, args: &[Bytes], out: &mut Out) -> CmdResult {
        match args.len() {
            2 => self.authenticate(None, &args[1])?,
            3 => self.authenticate(Some(&args[1]), &args[2])?,
            _ => return Err(CmdError::Arity("auth".into())),
        }
        self.publish(out.proto);
        out.ok();
        Ok(Flow::Continue)
    }

    pub(super) fn hello(&mut self, args: &[Bytes], out: &mut Out) -> CmdResult {
        let a = &args[1..];
        let mut proto = out.proto;
        let mut i = 0;
        if let Some(v) = a.first() {
            let v = parse_i64(v).map_err(|_| CmdError::ProtoNotInteger)?;
            if v != 2 && v != 3 {
                return Err(CmdError::NoProto);
            }
            proto = v as u8;
            i = 1;
        }
        let mut auth: Option<(&Bytes, &Bytes)> = None;
        let mut setname = None;
        while i < a.len() {
            if is(&a[i], "AUTH") && i + 2 < a.len() {
                auth = Some((&a[i + 1], &a[i + 2]));
                i += 3;
            } else if is(&a[i], "SETNAME") && i + 1 < a.len() {
                setname = Some(&a[i + 1]);
                i += 2;
            } else {
                return Err(CmdError::Syntax);
            }
        }
        if let Some(n) = setname {
            check_client_name(n)?;
        }
        if let Some((user, pass)) = auth {
            self.authenticate(Some(user), pass)?;
        }
        if self.principal.is_none() {
            return Err(CmdError::HelloNoAuth);
        }
        if let Some(n) = setname {
            self.name = (!n.is_empty()).then(|| n.clone());
        }
        out.proto = proto;
        self.publish(proto);
        out.map(7);
        out.bulk(b"server");
        out.bulk(b"redis");
        out.bulk(b"version");
        out.bulk(REDIS_VERSION.as_bytes());
        out.bulk(b"proto");
        out.int(i64::from(proto));
        out.bulk(b"id");
        out.int(self.id as i64);
        out.bulk(b"mode");
        out.bulk(b"standalone");
        out.bulk(b"role");
        out.bulk(b"master");
        out.bulk(b"modules");
        out.array(0);
        Ok(Flow::Continue)
    }

    pub(super) fn client(&mut self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
        let sub = String::from_utf8_lossy(&a[0]).to_ascii_uppercase();
        let arity = |ok: bool| if ok { Ok(()) } else { Err(CmdError::Arity(format!("client|{}", sub.to_lowercase()))) };
        match sub.as_str() {
            "SETINFO" => {
                arity(a.len() == 3)?;
                out.ok();
            }
            "SETNAME" => {
                arity(a.len() == 2)?;
                check_client_name(&a[1])?;
                self.name = (!a[1].is_empty()).then(|| a[1].clone());
                self.publish(out.proto);
                out.ok();
            }
            "GETNAME" => {
                arity(a.len() == 1)?;
                match &self.name {
                    Some(n) => out.bulk(n),
                    None => out.null(),
                }
            }
            "ID" => {
                arity(a.len() == 1)?;
                out.int(self.id as i64);
            }
            "INFO" => {
                arity(a.len() == 1)?;
                let name = self.name.as_deref().map(String::from_utf8_lossy).unwrap_or_default();
                let line = format!("id={} name={} db=0 namespace={} resp={}\n", self.id, name, self.ns, out.proto);
                out.bulk(line.as_bytes());
            }
            "LIST" => {
                // Redis's `CLIENT LIST [TYPE normal] [ID id ...]`; other filters are refused.
                let mut ids: Option<Vec<u64>> = None;
                let mut i = 1;
                while i < a.len() {
                    if is(&a[i], "TYPE") && i + 1 < a.len() {
                        if !is(&a[i + 1], "normal") {
                            ids = Some(Vec::new());
                        }
                        i += 2;
                    } else if is(&a[i], "ID") && i + 1 < a.len() {
                        let list = ids.get_or_insert_with(Vec::new);
                        for v in &a[i + 1..] {
                            list.push(parse_i64(v)? as u64);
                        }
                        i = a.len();
                    } else {
                        return Err(CmdError::Syntax);
                    }
                }
                let text = self.client_list(ids.as_deref());
                out.bulk(text.as_bytes());
            }
            "NO-EVICT" | "NO-TOUCH" | "REPLY" => {
                arity(a.len() == 2)?;
                out.ok();
            }
            _ => return Err(CmdError::UnknownSubcommand { cmd: "CLIENT", sub: String::from_utf8_lossy(&a[0]).into() }),
        }
        Ok(())
    }

    /// CLIENT LIST's lines: a tenant sees the connections working in its
    /// own namespace, the admin sees all.
    pub(super) fn client_list(&self, ids: Option<&[u64]>) -> String {
        let admin = self.principal.as_ref().is_some_and(Principal::is_admin);
        let clients = self.info.clients.lock();
        let mut t = String::new();
        for (id, c) in clients.iter() {
            if ids.is_some_and(|ids| !ids.contains(id)) || (!admin && c.namespace != self.ns) {
                continue;
            }
            let _ = writeln!(
                t,
                "id={id} addr={} laddr=127.0.0.1:{} name={} age={} db=0 namespace={} resp={} flags=N",
                c.addr,
                self.info.port,
                c.name,
                c.connected.elapsed().as_secs(),
                c.namespace,
                c.resp,
            );
        }
        t
    }
}

fn check_client_name(n: &[u8]) -> Result<(), CmdError> {
    if n.iter().all(|&c| (b'!'..=b'~').contains(&c)) {
        Ok(())
    } else {
        Err(CmdError::BadClientName)
    }
}
