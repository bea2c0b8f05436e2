// Test-only OpenID Connect provider for the Connect Broker test suite.
//
// A thin configuration layer over the `oidc-provider` package: it adds no endpoints of its own.
// Usage: node tests/idp/server.mjs <config.json>
// Prints exactly one line `READY <issuer>` to stdout once it is listening.
//
// Config (JSON):
//   port, issuer, jwks ({keys: [private JWKs]}), resources (resource indicators that receive
//   RFC 9068 JWT access tokens), access_token_ttl, clients (oidc-provider client metadata),
//   cookie_prefix (distinct cookie names per instance), extra_claims ({accountId: {claim: v}}),
//   pairwise_access_sub (access-token `sub` = "at-" + account id; ID tokens keep the account id).
import { readFileSync } from 'node:fs';
import process from 'node:process';

import Provider, { errors } from 'oidc-provider';

const configPath = process.argv[2];
if (!configPath) {
  process.stderr.write('usage: node server.mjs <config.json>\n');
  process.exit(2);
}

const cfg = JSON.parse(readFileSync(configPath, 'utf8'));

const port = Number(cfg.port);
const issuer = cfg.issuer ?? `http://127.0.0.1:${port}`;
const resources = new Set(cfg.resources ?? []);
const accessTokenTTL = Number(cfg.access_token_ttl ?? 600);
const cookiePrefix = cfg.cookie_prefix ?? 'idp';
const extraClaims = cfg.extra_claims ?? {};
const pairwiseAccessSub = Boolean(cfg.pairwise_access_sub);

// Every claim name that appears in extra_claims must be declared, or oidc-provider drops it.
const extraClaimNames = [...new Set(Object.values(extraClaims).flatMap((c) => Object.keys(c)))]
  .filter((name) => !['sub', 'name'].includes(name));

const RESOURCE_SCOPE = 'openid profile mcp:tools';

function claimsFor(accountId) {
  return { name: accountId, ...(extraClaims[accountId] ?? {}), sub: accountId };
}

const configuration = {
  clients: cfg.clients ?? [],
  jwks: cfg.jwks,

  // Plain HTTP on 127.0.0.1: cookies must not be `secure`; names are per instance because
  // browsers (and cookie jars) do not separate cookies by port.
  cookies: {
    names: {
      session: `${cookiePrefix}_session`,
      interaction: `${cookiePrefix}_interaction`,
      resume: `${cookiePrefix}_interaction_resume`,
    },
    long: { httpOnly: true, sameSite: 'lax', secure: false },
    short: { httpOnly: true, sameSite: 'lax', secure: false },
    keys: [`connect-broker-test-idp-${cookiePrefix}-b7f3c9e21d4a`],
  },

  claims: {
    openid: ['sub', ...extraClaimNames],
    profile: ['name'],
  },
  // Put scope-requested claims (profile, extra claims) into ID tokens even when an opaque
  // access token for userinfo is also issued (the default only puts them behind userinfo).
  conformIdTokenClaims: false,

  scopes: ['openid', 'offline_access', 'mcp:tools'],

  features: {
    devInteractions: { enabled: true },
    userinfo: { enabled: true },
    resourceIndicators: {
      enabled: true,
      // No default: a request without `resource` (e.g. the broker's own OIDC login) gets an
      // opaque access token plus an ID token.
      defaultResource: async (_ctx, _client, oneOf) => oneOf ?? undefined,
      useGrantedResource: async () => true,
      getResourceServerInfo: async (_ctx, resourceIndicator) => {
        if (!resources.has(resourceIndicator)) {
          throw new errors.InvalidTarget(`unknown resource indicator ${resourceIndicator}`);
        }
        return {
          scope: RESOURCE_SCOPE,
          audience: resourceIndicator,
          accessTokenFormat: 'jwt',
          accessTokenTTL,
          jwt: { sign: { alg: 'RS256' } },
        };
      },
    },
  },

  pkce: {
    // Required for public clients (token_endpoint_auth_method "none"); only S256 exists in 9.x.
    required: (_ctx, client) => client.clientAuthMethod === 'none',
  },

  clientBasedCORS: () => true,

  async findAccount(_ctx, id) {
    if (!id) return undefined;
    return {
      accountId: id,
      async claims() {
        return claimsFor(id);
      },
    };
  },

  // Auto-consent: whatever OIDC scopes, claims and resource scopes are requested get granted,
  // so the consent prompt never appears (unless the client explicitly sends prompt=consent).
  async loadExistingGrant(ctx) {
    const { oidc } = ctx;
    const grantId = oidc.result?.consent?.grantId || oidc.session.grantIdFor(oidc.client.clientId);
    let grant;
    if (grantId) grant = await oidc.provider.Grant.find(grantId);
    if (!grant) {
      grant = new oidc.provider.Grant({
        clientId: oidc.client.clientId,
        accountId: oidc.session.accountId,
      });
    }
    const oidcScopes = [...oidc.requestParamOIDCScopes];
    if (oidcScopes.length) grant.addOIDCScope(oidcScopes.join(' '));
    const claims = [...oidc.requestParamClaims];
    if (claims.length) grant.addOIDCClaims(claims);
    for (const [indicator, resourceServer] of Object.entries(oidc.resourceServers ?? {})) {
      const scopes = [...oidc.requestParamScopes].filter((s) => resourceServer.scopes.has(s));
      if (scopes.length) grant.addResourceScope(indicator, scopes.join(' '));
    }
    await grant.save();
    return grant;
  },

  // Entra-like: a client allowed to use refresh_token gets one (oidc-provider would otherwise
  // require scope=offline_access together with prompt=consent).
  issueRefreshToken: async (_ctx, client) => client.grantTypeAllowed('refresh_token'),

  async extraTokenClaims(_ctx, token) {
    if (token.kind !== 'AccessToken' || !token.accountId) return undefined;
    const extra = extraClaims[token.accountId];
    return extra ? { ...extra } : undefined;
  },

  formats: {
    customizers: {
      async jwt(_ctx, token, jwt) {
        if (pairwiseAccessSub && token.accountId) {
          jwt.payload.sub = `at-${token.accountId}`;
        }
      },
    },
  },

  async renderError(ctx, out) {
    ctx.type = 'json';
    ctx.body = out;
  },
};

const provider = new Provider(issuer, configuration);
provider.proxy = false;

provider.on('server_error', (_ctx, err) => {
  process.stderr.write(`server_error: ${err?.stack ?? err}\n`);
});

const server = provider.listen(port, '127.0.0.1', () => {
  process.stdout.write(`READY ${issuer}\n`);
});

server.on('error', (err) => {
  process.stderr.write(`listen error: ${err?.stack ?? err}\n`);
  process.exit(1);
});

function shutdown() {
  server.close(() => process.exit(0));
  server.closeAllConnections?.();
  setTimeout(() => process.exit(0), 2000).unref();
}

process.on('SIGTERM', shutdown);
process.on('SIGINT', shutdown);
